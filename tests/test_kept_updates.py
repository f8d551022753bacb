"""A bad live update must not replace good kept ones (issue 29). An update for a model that runs no worker
is checked against the model's files and refused at once, in the words a running worker uses; one the
files cannot judge is kept behind the last proven update, which the model falls back to if its start
refuses the newer one.

In process (fake workers, as tests/test_rollout_updates.py drives them) for the fallback, which needs
a refusal the headers cannot see; a real daemon (``--preload none``, tiny on disk) for the header checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemonkit import Daemon, http, shared_daemon, submit, wait_job
from test_rollout_updates import STATE, FakeModel, FakeWorker, lora_update

from diffusiond.client import AsyncClient, DaemonError
from diffusiond.client.weights import pack
from diffusiond.daemon.core.loras import LoraRegistry
from diffusiond.daemon.core.weights import LiveComponents, LiveLoras
from diffusiond.ipc.messages import Ack, UpdateWeights
from diffusiond.protocol import WorkerState


def refusing(worker: FakeWorker, version: int, why: str) -> None:
    """``worker`` refuses update ``version`` only (a start that finds what the headers could not)."""
    real = worker.command

    async def command(msg: Any, timeout: float, fds: Any = ()) -> Ack:
        ack = await real(msg, timeout, fds)
        return Ack(0, False, why) if msg.version == version else ack

    worker.command = command  # type: ignore[method-assign]


async def test_a_kept_update_refused_at_the_start_falls_back_to_the_last_good_one() -> None:
    components = LiveComponents()
    model = FakeModel("tiny", [])

    async def send(value: float) -> int:
        fds, tensors = pack({"conv_out.weight": np.full((4, 4), value, np.float32)})
        return await components.update(UpdateWeights("tiny", "unet", tensors), fds, lambda _: model, 5)  # type: ignore[arg-type,return-value]

    model.workers.append(FakeWorker("w0"))
    assert await send(1) == 1  # proven: a worker applied it
    model.workers.clear()  # the model goes to disk
    assert [await send(2), await send(3)] == [2, 3]  # on trust: 3 replaces 2, not the proven 1
    assert [(e.msg.version, e.proven) for e in components.kept[("tiny", "unet")]] == [(1, True), (3, False)]
    started = FakeWorker("w1", WorkerState.STARTING)
    refusing(started, 3, "unet keeps it as torch.float8_e4m3fn, which is not updated in place")
    await components.replay(model, started, 5)  # type: ignore[arg-type]
    assert [m.version for m in started.got] == [1, 3]  # the worker runs 1, not the files' values
    assert [e.msg.version for e in components.kept[("tiny", "unet")]] == [1]  # and the next one starts at 1
    assert components.weight_errors("tiny")["unet"].endswith(
        "which is not updated in place; in force instead: version 1")
    # one taken at a start is proven there: the older one it covers is let go
    assert await send(4) == 4
    await components.replay(model, FakeWorker("w2", WorkerState.STARTING), 5)  # type: ignore[arg-type]
    assert [(e.msg.version, e.proven) for e in components.kept[("tiny", "unet")]] == [(4, True)]


async def test_a_later_adapter_update_refused_at_the_start_leaves_the_adapter_at_its_last_good_version() -> None:
    live = LiveLoras(LoraRegistry({}, 3))
    model = FakeModel("tiny", [FakeWorker("w0")])
    assert await lora_update(live, "trainer", [model]) == 1
    model.workers.clear()
    assert await lora_update(live, "trainer", [model], {k: v * 2 for k, v in STATE.items()}) == 2
    started = FakeWorker("w1", WorkerState.STARTING)
    refusing(started, 2, "RuntimeError: hot-swap refused")
    await live.replay(model, started, 5)  # type: ignore[arg-type]
    assert "trainer" not in model.lora_errors  # still served, at version 1
    assert live.refused["trainer"].endswith("hot-swap refused; in force instead: version 1"), live.refused
    assert [e.msg.version for e in live.kept["trainer"]] == [1]
    # an update of an existing adapter is checked against its tensors with no worker at all
    with pytest.raises(Exception, match=r"has shape \[3, 4\]; LoRA 'trainer' has \[2, 4\] there"):
        await lora_update(live, "trainer", [model], {**STATE, "unet.a.to_q.lora_A.weight": np.ones((3, 4), np.float32)})


SMALL = {"model": "tiny", "width": 64, "height": 64, "steps": 1, "prompt": "a lighthouse", "seed": 1,
         "output_format": "npy"}


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    args = ["--model", "tiny", "--preload", "none", "--workers", "1", "--no-persist", "--job-timeout", "300"]
    with shared_daemon(tmp_path_factory.mktemp("kept"), args, model_cache, {"OMP_NUM_THREADS": "1"}) as d:
        yield d


async def test_updates_for_a_model_on_disk_are_checked_against_its_files(
        cold: Daemon, lora_files: dict[str, Path]) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from diffusiond.pipelines.tiny import ensure_tiny

    misfit = load_file(str(lora_files["misfit"] / "pytorch_lora_weights.safetensors"))  # a lora_A too wide
    dots = load_file(str(lora_files["dots"] / "pytorch_lora_weights.safetensors"))
    with safe_open(str(ensure_tiny() / "unet" / "diffusion_pytorch_model.safetensors"), "np") as f:
        conv_out = f.get_tensor("conv_out.weight")
    async with AsyncClient(str(cold.socket)) as c, http(cold.socket) as s:
        assert await c.update_weights("tiny", "unet", {"conv_out.weight": conv_out * 0.5}) == 1
        bad = {"conv_out.weight": np.zeros((3, *conv_out.shape[1:]), conv_out.dtype)}
        for state, component, words in [
                (bad, "unet", "unet of model tiny: update refused: tensor 'conv_out.weight' has shape [3, "),
                ({"conv_out.nope": conv_out}, "unet", "tensor 'conv_out.nope': unet of model tiny has no parameter"),
                ({"x.weight": conv_out}, "transformer", "model tiny has no component 'transformer'; its components: "
                                                        "text_encoder, unet, vae")]:
            with pytest.raises(DaemonError) as err:
                await c.update_weights("tiny", component, state)
            assert err.value.status == 400 and words in str(err.value), err.value
        with pytest.raises(DaemonError) as err:
            await c.update_lora("misfit", misfit)
        assert err.value.status == 400 and "needs" in str(err.value), err.value
        assert await c.update_lora("trainer", dots) == 1
        key = next(k for k in sorted(dots) if k.endswith("lora_A.weight"))
        with pytest.raises(DaemonError) as err:
            await c.update_lora("trainer", {**dots, key: np.zeros((9, dots[key].shape[1]), np.float32)})
        assert err.value.status == 400 and "LoRA 'trainer' has [" in str(err.value), err.value

        # nothing bad was kept: tiny's first job runs the good versions, and nothing is refused at its start
        job = await wait_job(s, (await submit(s, {**SMALL, "loras": [{"name": "trainer", "weight": 1.0}]}))["id"],
                             300)
        assert job["status"] == "succeeded", job
        assert job["weight_versions"] == {"unet": 1} and job["lora_versions"] == {"trainer": 1}, job
        models = (await c._json("GET", "/v1/models"))["data"]
        assert next(m for m in models if m["id"] == "tiny")["weight_errors"] == {}


HALF = ("the copy failed after it began (OSError: [Errno 5] Input/output error); the worker restarts from the files "
        "and the updates accepted before this one")


def half_applying(worker: FakeWorker, version: int) -> None:
    """``worker`` fails half-way through copying update ``version`` (an I/O error, not a refusal) and exits."""
    real = worker.command

    async def command(msg: Any, timeout: float, fds: Any = ()) -> Ack:
        ack = await real(msg, timeout, fds)
        return Ack(0, False, HALF, restarts=True) if msg.version == version else ack

    worker.command = command  # type: ignore[method-assign]


async def test_a_worker_that_fails_half_way_through_a_kept_update_at_its_start_leaves_it_kept() -> None:
    """The replacement of a worker whose copy failed half-way must get the update again, not the
    files' values while the model's other workers run it; only a crash loop drops it, saying so.
    only failures in a row are one (a start that took it in between starts the count over), and the message says
    that the workers running it keep it."""
    from diffusiond.daemon.core.kept import MAX_RESTARTS

    components = LiveComponents()
    model = FakeModel("tiny", [FakeWorker("w0")])

    async def send(value: float) -> int:
        fds, tensors = pack({"conv_out.weight": np.full((4, 4), value, np.float32)})
        return await components.update(UpdateWeights("tiny", "unet", tensors), fds, lambda _: model, 5)  # type: ignore[arg-type,return-value]

    assert [await send(1), await send(2)] == [1, 2]
    chain = components.kept[("tiny", "unet")]
    for n in range(1, MAX_RESTARTS):
        started = FakeWorker(f"w{n}", WorkerState.STARTING)
        half_applying(started, 2)
        await components.replay(model, started, 5)  # type: ignore[arg-type]
        assert [(e.msg.version, e.proven) for e in chain] == [(2, True)]  # kept for its replacement
        assert components.weight_errors("tiny") == {}
    replacement = FakeWorker("r", WorkerState.STARTING)
    await components.replay(model, replacement, 5)  # type: ignore[arg-type]
    assert [m.version for m in replacement.got] == [2]
    for n in range(1, MAX_RESTARTS):  # the start that took it ended the run of failures before
        started = FakeWorker(f"v{n}", WorkerState.STARTING)
        half_applying(started, 2)
        await components.replay(model, started, 5)  # type: ignore[arg-type]
        assert [(e.msg.version, e.restarts) for e in components.kept[("tiny", "unet")]] == [(2, n)]
    last = FakeWorker("w9", WorkerState.STARTING)
    half_applying(last, 2)
    await components.replay(model, last, 5)  # type: ignore[arg-type]
    assert components.kept[("tiny", "unet")] == []  # the bound: a model does not restart forever
    assert components.weight_errors("tiny")["unet"] == (
        f"update version 2 was dropped: {MAX_RESTARTS} workers in a row failed while copying it when they started "
        f"(the last: {HALF}); in force instead: the files' values on workers that start from now on, while the "
        "workers already running (w0) keep version 2")
    model.workers.clear()  # with no worker running it, the files' values are all there is
    assert await send(3) == 3
    for n in range(MAX_RESTARTS):
        started = FakeWorker(f"x{n}", WorkerState.STARTING)
        half_applying(started, 3)
        await components.replay(model, started, 5)  # type: ignore[arg-type]
    assert components.weight_errors("tiny")["unet"].endswith(f"(the last: {HALF}); in force instead: the files' "
                                                            "values")


async def test_a_worker_that_fails_half_way_through_a_kept_adapter_update_leaves_it_kept() -> None:
    """For an adapter: an update kept on trust is not dropped, the worker is sent nothing more (it
    exits), and the model still serves the adapter."""
    from diffusiond.daemon.core.kept import MAX_RESTARTS

    live = LiveLoras(LoraRegistry({}, 3))
    model = FakeModel("tiny", [FakeWorker("w0")])
    assert await lora_update(live, "trainer", [model]) == 1
    model.workers.clear()
    assert await lora_update(live, "trainer", [model], {k: v * 2 for k, v in STATE.items()}) == 2
    for n in range(1, MAX_RESTARTS):
        started = FakeWorker(f"w{n}", WorkerState.STARTING)
        half_applying(started, 2)
        await live.replay(model, started, 5)  # type: ignore[arg-type]
        assert [(e.msg.version, e.proven) for e in live.kept["trainer"]] == [(1, True), (2, False)]
        assert "trainer" not in live.refused and "trainer" not in model.lora_errors
    last = FakeWorker("w9", WorkerState.STARTING)
    half_applying(last, 2)
    await live.replay(model, last, 5)  # type: ignore[arg-type]
    assert [e.msg.version for e in live.kept["trainer"]] == [1]
    assert live.refused["trainer"].startswith(f"update version 2 was dropped: {MAX_RESTARTS} workers in a row failed "
                                              "while copying it when they started (the last of model tiny: the copy")
    assert live.refused["trainer"].endswith("in force instead: version 1")
    assert "trainer" not in model.lora_errors


async def test_a_proven_adapter_update_dropped_at_the_bound_counts_failures_in_a_row_and_says_who_keeps_it() -> None:
    """For an adapter: a start that took the update ends a run of failures; once a run reaches the
    bound, the message says that the workers already running keep the dropped version."""
    from diffusiond.daemon.core.kept import MAX_RESTARTS

    live = LiveLoras(LoraRegistry({}, 3))
    model = FakeModel("tiny", [FakeWorker("w0")])
    assert await lora_update(live, "trainer", [model]) == 1
    b_only = {"unet.a.to_q.lora_B.weight": STATE["unet.a.to_q.lora_B.weight"] * 2}
    assert await lora_update(live, "trainer", [model], b_only) == 2  # proven: w0 runs it

    async def start(name: str, fails: bool) -> None:
        started = FakeWorker(name, WorkerState.STARTING)
        if fails:
            half_applying(started, 2)
        await live.replay(model, started, 5)  # type: ignore[arg-type]

    for n, fails in enumerate([True, True, False, True, True]):
        await start(f"w{n + 1}", fails)
    assert [(e.msg.version, e.restarts) for e in live.kept["trainer"]] == [(1, 0), (2, MAX_RESTARTS - 1)]
    assert "trainer" not in live.refused
    await start("w9", True)
    assert [e.msg.version for e in live.kept["trainer"]] == [1]
    assert live.refused["trainer"].endswith("in force instead: version 1 on workers that start from now on, while "
                                            "the workers already running keep version 2"), live.refused


async def test_an_adapter_whose_only_kept_update_is_dropped_at_the_bound_is_served_again_once_sent_whole() -> None:
    """Dropping the one update that holds an adapter's tensors must not leave the name refusing
    every update (nor new workers building a part of it from later ones): the models' next starts refuse it, the
    message says to send all of its tensors, and such an update serves it everywhere again."""
    from diffusiond.daemon.core.kept import MAX_RESTARTS

    live = LiveLoras(LoraRegistry({}, 3))
    model = FakeModel("tiny", [FakeWorker("w0")])
    assert await lora_update(live, "trainer", [model]) == 1
    for n in range(1, MAX_RESTARTS + 1):
        started = FakeWorker(f"w{n}", WorkerState.STARTING)
        half_applying(started, 1)
        await live.replay(model, started, 5)  # type: ignore[arg-type]
    assert live.kept["trainer"] == []
    why = live.refused["trainer"]
    assert why.endswith("no kept update holds all of the adapter now, so workers that start from now on run without "
                        "it and their models refuse it (workers already running keep version 1): send all of its 2 "
                        "tensors in one update_lora of 'trainer' to serve it everywhere again"), why
    await live.replay(model, FakeWorker("r", WorkerState.STARTING), 5)  # type: ignore[arg-type]
    assert model.lora_errors["trainer"] == why  # the replacement runs without it: the model refuses it
    with pytest.raises(Exception, match=r"it holds 1 of the 2 tensors of LoRA 'trainer', .* send all 2 in one update"):
        await lora_update(live, "trainer", [model], {"unet.a.to_q.lora_B.weight": STATE["unet.a.to_q.lora_B.weight"]})
    assert await lora_update(live, "trainer", [model], {k: v * 3 for k, v in STATE.items()}) == 2
    assert "trainer" not in model.lora_errors and "trainer" not in live.refused
    assert [(e.msg.version, e.proven) for e in live.kept["trainer"]] == [(2, True)]
    later = FakeWorker("w9", WorkerState.STARTING)
    await live.replay(model, later, 5)  # type: ignore[arg-type]
    assert [m.version for m in later.got] == [2] and "trainer" not in model.lora_errors
    b_only = {"unet.a.to_q.lora_B.weight": STATE["unet.a.to_q.lora_B.weight"]}
    assert await lora_update(live, "trainer", [model], b_only) == 3  # a part of it is an update again


def test_retiring_an_update_closes_each_of_its_memfds_and_logs_one_that_fails(
        caplog: pytest.LogCaptureFixture) -> None:
    """A failing close (EBADF: a double close elsewhere) is logged with the update and the fd, and
    does not leave the update's other memfds, and their pages, open."""
    import os

    from diffusiond.daemon.core import kept

    good = os.memfd_create("part")
    bad = 1 << 20  # no such fd
    msg = UpdateWeights("tiny", "unet", [], 4)
    kept.retire(kept.Kept(msg, (bad, good), proven=True))
    kept._closer.submit(lambda: None).result(10)  # one thread: the retire ran before
    with pytest.raises(OSError):
        os.fstat(good)
    assert f"closing memfd {bad} of the kept unet of model tiny update version 4 failed" in caplog.text
