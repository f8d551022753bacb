"""Live updates (issue 29) in the engine's bookkeeping, in process: fake workers whose answers the test
holds back, so orderings that a real daemon reaches only by luck are reached every time. Last, the
same against a real daemon that starts with no model loaded (``--preload none``), as a trainer finds
it after a level-2 sleep or a keep_alive that ran out.

``LiveLoras`` and ``LiveComponents`` are driven as the engine drives them: ``update`` for the trainer's
call, ``replay`` for a worker that came up (``Engine._prepare_worker``). A fake worker records what it
was sent and answers when the test lets it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemonkit import Daemon, http, shared_daemon, submit, wait_job
from enginekit import until

from diffusiond.client import AsyncClient
from diffusiond.client.weights import pack
from diffusiond.daemon.core.loras import LoraRegistry
from diffusiond.daemon.core.weights import LiveComponents, LiveLoras
from diffusiond.ipc.messages import Ack, UpdateLora, UpdateWeights
from diffusiond.protocol import WorkerState

STATE = {"unet.a.to_q.lora_A.weight": np.ones((2, 4), np.float32),
         "unet.a.to_q.lora_B.weight": np.ones((4, 2), np.float32)}


class FakeWorker:
    def __init__(self, name: str, state: WorkerState = WorkerState.READY, refuse: str = "",
                 fail: BaseException | None = None) -> None:
        self.name = name
        self.state = state
        self.refuse = refuse
        self.fail = fail  # raised instead of an answer (a timeout, a channel that closed)
        self.asked_to_stop = False
        self.got: list[Any] = []
        self.gate: asyncio.Event | None = None  # set: the answer waits for it

    async def command(self, msg: Any, timeout: float, fds: Any = ()) -> Ack:
        for fd in fds:
            os.close(fd)
        self.got.append(msg)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return Ack(0, not self.refuse, self.refuse)


@dataclass
class FakeModel:
    name: str
    workers: list[Any]
    lora_errors: dict[str, str] = field(default_factory=dict)


async def lora_update(live: LiveLoras, name: str, models: list[FakeModel], state: dict[str, Any] = STATE) -> int:
    fds, tensors = pack(state)
    return await live.update(UpdateLora(name, tensors), fds, models, 5)  # type: ignore[arg-type]





async def race(live: LiveLoras | LiveComponents, send: Any) -> list[int]:
    """The first update of a session (nothing kept yet) is on its way to the model's live worker when
    another worker of the model comes up: the versions that the new one's replay sent it, and the
    update's own."""
    old = FakeWorker("w0")
    old.gate = asyncio.Event()
    model = FakeModel("tiny", [old])
    update = asyncio.ensure_future(send(model))
    await until(lambda: old.got)  # the update holds the lock, waiting for w0's answer
    new = FakeWorker("w1", WorkerState.STARTING)
    model.workers.append(new)
    replay = asyncio.ensure_future(live.replay(model, new, 5))  # type: ignore[arg-type]
    for _ in range(20):
        await asyncio.sleep(0)
    old.gate.set()
    version = await update
    await replay
    assert "trainer" not in model.lora_errors
    return [*(m.version for m in new.got), version]


async def test_a_worker_starting_while_the_first_update_is_in_flight_gets_it() -> None:
    """The new worker was not among the live ones the update went to, so its replay must send it."""
    live = LiveLoras(LoraRegistry({}, 3))
    assert await race(live, lambda model: lora_update(live, "trainer", [model])) == [1, 1]


async def test_a_worker_starting_while_the_first_component_update_is_in_flight_gets_it() -> None:
    live = LiveComponents()
    (fd,), tensors = pack({"conv_out.weight": np.zeros((4, 4), np.float32)})
    assert await race(live, lambda model: live.update(UpdateWeights("tiny", "unet", tensors), [fd],
                                                      lambda _name: model, 5)) == [1, 1]


async def test_versions_count_accepted_updates_only() -> None:
    """Refusals by every worker leave the count where it was: the first accepted update is 1."""
    from diffusiond.daemon.errors import InvalidRequest

    live = LiveLoras(LoraRegistry({}, 3))
    worker = FakeWorker("w0", refuse="tensor 'unet.a.to_q.lora_A.weight': unet of model tiny has no module 'a'")
    model = FakeModel("tiny", [worker])
    for _ in range(3):
        try:
            await lora_update(live, "p2", [model])
        except InvalidRequest as exc:
            assert exc.field == "tensors" and "tiny: tensor 'unet.a.to_q" in exc.message
        else:
            raise AssertionError("a refused update was accepted")
    worker.refuse = ""
    assert await lora_update(live, "p2", [model]) == 1
    worker.refuse = "tensor 'unet.a.to_q.lora_A.weight' has shape [3, 4]; LoRA 'p2' has [2, 4] there"
    try:
        await lora_update(live, "p2", [model])
    except InvalidRequest:
        pass
    worker.refuse = ""
    assert await lora_update(live, "p2", [model]) == 2 == live.version("p2")

    components = LiveComponents()
    worker.refuse = "tensor 'conv_out.nope': unet of model tiny has no parameter of that name"
    fds, tensors = pack({"conv_out.nope": np.zeros((4, 4), np.float32)})
    try:
        await components.update(UpdateWeights("tiny", "unet", tensors), fds, lambda _: model, 5)  # type: ignore[arg-type,return-value]
    except InvalidRequest as exc:
        assert "conv_out.nope" in exc.message
    worker.refuse = ""
    fds, tensors = pack({"conv_out.weight": np.zeros((4, 4), np.float32)})
    assert await components.update(UpdateWeights("tiny", "unet", tensors), fds, lambda _: model, 5) == 1  # type: ignore[arg-type,return-value]


async def test_an_update_no_running_model_can_check_is_kept_for_the_model_that_starts_next() -> None:
    """The SD model is on disk, the FLUX one runs and cannot take UNet weights: the update is kept for
    the SD model (its refusal by FLUX shows on FLUX's entry only), whose next worker gets it."""
    live = LiveLoras(LoraRegistry({}, 3))
    flux = FakeModel("tiny-flux", [FakeWorker("w0", refuse="tensor 'unet.a.to_q.lora_A.weight': model tiny-flux "
                                                            "has no component 'unet'; keys start with transformer")])
    sd = FakeModel("tiny", [])
    assert await lora_update(live, "sdlora", [flux, sd]) == 1
    assert "no component 'unet'" in flux.lora_errors["sdlora"] and "sdlora" not in sd.lora_errors
    assert await lora_update(live, "sdlora", [flux, sd], {k: v * 2 for k, v in STATE.items()}) == 2
    started = FakeWorker("w1", WorkerState.STARTING)
    sd.workers.append(started)
    await live.replay(sd, started, 5)  # type: ignore[arg-type]
    assert [m.version for m in started.got] == [2] and "sdlora" not in sd.lora_errors
    # a worker of it that refuses the kept update: the model's entry says why, as a live refusal does
    other = FakeModel("other", [])
    assert await lora_update(live, "late", [other]) == 1
    refusing = FakeWorker("w2", WorkerState.STARTING, refuse="unet of model other has no module 'a'")
    other.workers.append(refusing)
    await live.replay(other, refusing, 5)  # type: ignore[arg-type]
    assert other.lora_errors["late"] == "unet of model other has no module 'a'"


async def test_a_component_update_for_a_model_with_no_worker_is_kept_and_checked_at_its_start() -> None:
    components = LiveComponents()
    model = FakeModel("tiny", [])

    async def send(name: str) -> int:
        fds, tensors = pack({name: np.zeros((4, 4), np.float32)})
        return await components.update(UpdateWeights("tiny", "unet", tensors), fds, lambda _: model, 5)  # type: ignore[arg-type,return-value]

    assert [await send("conv_out.weight"), await send("conv_out.nope"), await send("conv_in.weight")] == [1, 2, 3]
    worker = FakeWorker("w0", WorkerState.STARTING, refuse="")
    real_command = worker.command

    async def picky(msg: Any, timeout: float, fds: Any = ()) -> Ack:
        ack = await real_command(msg, timeout, fds)
        return Ack(0, False, "no parameter of that name") if msg.tensors[0].name == "conv_out.nope" else ack

    worker.command = picky  # type: ignore[method-assign]
    await components.replay(model, worker, 5)  # type: ignore[arg-type]
    assert [m.version for m in worker.got] == [1, 2, 3]  # the refused one did not stop the rest
    assert [e.msg.version for e in components.kept[("tiny", "unet")]] == [1, 3]  # and is not sent again
    # its call returned 2 long ago: the model's entry says why, and the later 3 of that start does not hide it
    assert components.weight_errors("tiny") == {
        "unet": "update version 2 was refused when the model started, and dropped: no parameter of that name; "
                 "in force instead: the files' values"}
    worker.state = WorkerState.READY
    model.workers.append(worker)
    assert await send("conv_in.weight") == 4  # sent after the refusal, accepted: the refusal is over
    assert components.weight_errors("tiny") == {}


async def test_a_late_ack_answers_its_own_command_not_the_next_of_its_kind() -> None:
    """An update that timed out (the worker was in a long batch) is still queued in the worker;
    its ACK, when it comes, must not answer the retry, which the worker has not read yet."""
    import types

    from diffusiond.daemon.workers.handle import WorkerHandle
    from diffusiond.ipc.frames import Frame
    from diffusiond.ipc.messages import Kind

    class Channel:
        closed = False

        def __init__(self) -> None:
            self.sent: list[Any] = []

        def post(self, msg: Any, fds: Any = (), close_fds: bool = False) -> None:
            self.sent.append(msg)
            for fd in fds:
                os.close(fd)

    handle = WorkerHandle(types.SimpleNamespace(worker_id=0, device="cpu"),  # type: ignore[arg-type]
                          on_frame=lambda *a: None, on_lost=lambda *a: None)
    channel = Channel()
    handle.channel = channel  # type: ignore[assignment]
    (fd,), tensors = pack(STATE)
    try:
        with pytest.raises(TimeoutError):
            await handle.command(UpdateLora("trainer", tensors, 1), 0.01, [os.dup(fd)])
        retry = asyncio.ensure_future(handle.command(UpdateLora("trainer", tensors, 2), 30, [os.dup(fd)]))
        await until(lambda: len(channel.sent) == 2)
        first, second = channel.sent
        assert first.ack_id != second.ack_id and first.version == 1 and second.version == 2
        handle._on_frame(Frame(Kind.ACK, 0, Ack(Kind.UPDATE_LORA, False, "v1's refusal", ack_id=first.ack_id)))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not retry.done()  # v1's late answer was dropped, not taken as v2's
        handle._on_frame(Frame(Kind.ACK, 1, Ack(Kind.UPDATE_LORA, True, ack_id=second.ack_id)))
        assert (await retry).ok
    finally:
        os.close(fd)


def two_workers(second: FakeWorker) -> FakeModel:
    return FakeModel("tiny", [FakeWorker("w0"), second])


async def component_update(live: LiveComponents, model: FakeModel) -> int:
    fds, tensors = pack({"conv_out.weight": np.zeros((4, 4), np.float32)})
    return await live.update(UpdateWeights("tiny", "unet", tensors), fds, lambda _: model, 5)  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize("second", ["refuses", "does not answer"])
async def test_a_component_update_some_workers_took_is_a_conflict_that_says_so(second: str) -> None:
    """W0 applied it, w1 did not: not a 400 on tensors saying it was refused, but a 409 saying
    how many applied it and to send it again; the split shows in weight_errors until an update after it
    is accepted, and its version is never given again."""
    from diffusiond.daemon.edge.status import status_of
    from diffusiond.daemon.errors import UpdateSplit

    other = FakeWorker("w1", refuse="no parameter of that name") if second == "refuses" else \
        FakeWorker("w1", fail=TimeoutError())
    model = two_workers(other)
    live = LiveComponents()
    with pytest.raises(UpdateSplit) as err:
        await component_update(live, model)
    assert status_of(err.value) == 409 and err.value.code == "update_split"
    message = err.value.message
    assert "applied by 1 of 2 workers of model tiny" in message and "send the update again" in message
    assert ("w1 refused it: no parameter of that name" if second == "refuses" else "did not answer within 5s") \
        in message
    assert live.weight_errors("tiny") == {"unet": message}
    from diffusiond.client import DaemonError
    from diffusiond.client import UpdateSplit as ClientSplit
    from diffusiond.client.errors import update_error

    raised = update_error(409, err.value.code, message)  # what the trainer's update_weights raises
    assert isinstance(raised, ClientSplit) and isinstance(raised, DaemonError) and raised.status == 409
    other.refuse, other.fail = "", None
    assert await component_update(live, model) == 2  # 1 is held by w0
    assert live.weight_errors("tiny") == {}


async def test_a_component_update_its_only_worker_did_not_answer_is_unavailable_not_refused() -> None:
    """Nothing is wrong with the tensors; the worker may still apply it: a 503, send it again."""
    from diffusiond.daemon.errors import Unavailable

    live = LiveComponents()
    model = FakeModel("tiny", [FakeWorker("w0", fail=TimeoutError())])
    with pytest.raises(Unavailable) as err:
        await component_update(live, model)
    assert "did not answer within 5s" in err.value.message and "send the update again" in err.value.message
    model.workers[0].fail = None
    assert await component_update(live, model) == 2


async def test_a_lora_update_some_workers_of_a_model_took_is_a_conflict_and_the_next_one_reaches_it() -> None:
    from diffusiond.daemon.errors import UpdateSplit

    live = LiveLoras(LoraRegistry({}, 3))
    other = FakeWorker("w1")
    model = two_workers(other)
    assert await lora_update(live, "trainer", [model]) == 1
    other.fail = TimeoutError()
    with pytest.raises(UpdateSplit) as err:
        await lora_update(live, "trainer", [model])
    assert "applied by 1 of 2 workers of model tiny" in err.value.message
    other.fail = None
    assert await lora_update(live, "trainer", [model]) == 3  # sent to the split model again, and taken
    assert "trainer" not in model.lora_errors and [m.version for m in other.got] == [1, 2, 3]


@pytest.mark.parametrize("asked_to_stop", [True, False])
async def test_a_worker_that_goes_away_mid_update(asked_to_stop: bool) -> None:
    """One the engine stopped (keep_alive, unload) leaves the model with no live worker: the
    update is kept for the next one, as for a model on disk. One that crashed may have applied it: a 503."""
    from diffusiond.daemon.errors import Unavailable
    from diffusiond.ipc.errors import ChannelClosed

    worker = FakeWorker("w0", fail=ChannelClosed("worker 0 exited with code 0"))
    worker.asked_to_stop = asked_to_stop
    model = FakeModel("tiny", [worker])
    live, loras = LiveComponents(), LiveLoras(LoraRegistry({}, 3))
    if asked_to_stop:
        assert await component_update(live, model) == 1
        assert [e.proven for e in live.kept[("tiny", "unet")]] == [False]  # checked when it next starts
        assert await lora_update(loras, "trainer", [model]) == 1 and "trainer" not in model.lora_errors
    else:
        with pytest.raises(Unavailable):
            await component_update(live, model)
        with pytest.raises(Unavailable):
            await lora_update(loras, "trainer", [model])


@pytest.fixture(scope="module")
def cold_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    args = ["--model", "tiny", "--model", "tiny-flux", "--preload", "none", "--workers", "1", "--no-persist",
            "--job-timeout", "300"]
    with shared_daemon(tmp_path_factory.mktemp("cold"), args, model_cache, {"OMP_NUM_THREADS": "1"}) as d:
        yield d


async def test_updates_for_a_model_on_disk_are_taken_and_its_next_job_runs_them(
        cold_daemon: Daemon, lora_files: dict[str, Path]) -> None:
    """tiny has never been loaded, tiny-flux runs: a UNet adapter is not refused for what tiny-flux lacks,
    a UNet parameter update is not a 503, and tiny's first job runs both at version 1."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from diffusiond.pipelines.tiny import ensure_tiny

    dots = load_file(str(lora_files["dots"] / "pytorch_lora_weights.safetensors"))
    with safe_open(str(ensure_tiny() / "unet" / "diffusion_pytorch_model.safetensors"), "np") as f:
        conv_out = f.get_tensor("conv_out.weight")
    small = {"width": 64, "height": 64, "steps": 1, "prompt": "a lighthouse", "seed": 1, "output_format": "npy"}
    async with AsyncClient(str(cold_daemon.socket)) as c, http(cold_daemon.socket) as s:
        flux = await wait_job(s, (await submit(s, {**small, "model": "tiny-flux"}))["id"], 300)
        assert flux["status"] == "succeeded", flux
        assert await c.update_lora("trainer", dots) == 1
        assert await c.update_weights("tiny", "unet", {"conv_out.weight": conv_out * 0.5}) == 1
        entry = next(e for e in (await c._json("GET", "/v1/loras"))["data"] if e["name"] == "trainer")
        assert entry["version"] == 1 and "tiny" in entry["models"] and "unet" in entry["unfit"]["tiny-flux"]
        job = await wait_job(s, (await submit(s, {**small, "model": "tiny",
                                                  "loras": [{"name": "trainer", "weight": 1.0}]}))["id"], 300)
        assert job["status"] == "succeeded", job
        assert job["lora_versions"] == {"trainer": 1} and job["weight_versions"] == {"unet": 1}


def test_the_client_sends_values_not_raw_bytes_and_refuses_what_it_cannot_send() -> None:
    """A big-endian array arrives as its values; float8/complex/float64 and NaN/inf are refused before
    anything is sent, the tensor named (and, for a dtype, the ones that are taken)."""
    import mmap

    import torch

    values = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    (fd,), tensors = pack({"unet.a.lora_A.weight": values.astype(">f4"), "unet.a.lora_B.weight": values.T.copy()})
    try:
        with mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            got = [np.frombuffer(mm, np.float32, count=12, offset=t.offset).reshape(t.shape).copy() for t in tensors]
    finally:
        os.close(fd)
    assert [t.dtype for t in tensors] == ["float32", "float32"]
    assert np.array_equal(got[0], values) and np.array_equal(got[1], values.T)
    for bad in (torch.zeros(2, 4, dtype=torch.float8_e4m3fn), torch.zeros(2, 4, dtype=torch.complex64),
                np.zeros((2, 4), np.float64)):
        with pytest.raises(TypeError) as err:
            pack({"unet.a.lora_A.weight": bad})
        assert "'unet.a.lora_A.weight'" in str(err.value) and "float32, float16, bfloat16" in str(err.value)
    for bad in (torch.full((2, 4), float("nan"), dtype=torch.bfloat16), np.full((2, 4), np.inf, np.float16)):
        with pytest.raises(ValueError) as err:
            pack({"unet.a.lora_A.weight": np.ones((2, 4), np.float32), "unet.a.lora_B.weight": bad})
        assert "tensor 'unet.a.lora_B.weight' holds NaN or infinite values" in str(err.value)


def test_the_worker_reads_back_what_the_client_packed_and_refuses_a_memfd_shrunk_after_sending() -> None:
    """Every dtype's values round-trip, the largest finite values and signed zeros included (the client's finite
    check reads exponent bits); a memfd the client shrinks after the engine's check is a refused update naming the
    tensor, never a worker killed by SIGBUS (issue 29)."""
    import torch

    from diffusiond.ipc.messages import UpdateLora
    from diffusiond.worker.weights import read_tensors

    state = {"unet.a.lora_A.weight": torch.tensor([[3.3895e38, -0.0, 1.0]], dtype=torch.bfloat16),
             "unet.a.lora_B.weight": np.array([[65504.0], [-65504.0], [6e-8]], np.float16),
             "unet.b.lora_A.weight": np.array([[np.finfo(np.float32).max, -np.finfo(np.float32).tiny]], np.float32)}
    fds, tensors = pack(state)
    got = read_tensors(UpdateLora("t", tensors), fds)
    assert torch.equal(got["unet.a.lora_A.weight"], state["unet.a.lora_A.weight"])
    for key in ("unet.a.lora_B.weight", "unet.b.lora_A.weight"):
        assert np.array_equal(got[key].numpy(), state[key]) and got[key].numpy().dtype == state[key].dtype
    for bad in (torch.tensor([[1.0, float("-inf")]], dtype=torch.bfloat16), np.array([1.0, np.nan], np.float32)):
        with pytest.raises(ValueError, match="holds NaN or infinite values"):
            pack({"unet.a.lora_A.weight": bad})
    (fd,), tensors = pack(state)
    with pytest.raises(PermissionError):  # sealed: the client itself cannot shrink it after sending
        os.ftruncate(fd, 0)
    last = max(tensors, key=lambda t: t.offset)
    unsealed = os.memfd_create("unsealed")  # what the engine refuses; a read that met one still refuses
    os.sendfile(unsealed, fd, 0, last.offset + 2)
    os.close(fd)
    fd = unsealed
    with pytest.raises(ValueError) as err:
        read_tensors(UpdateLora("t", tensors), [fd])
    assert f"{last.name!r}" in str(err.value) and "shrank" in str(err.value)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the read, whatever happened


def half_applied(worker: FakeWorker) -> FakeWorker:
    """``worker`` fails half-way through copying every update (an I/O error, not a refusal) and exits."""
    async def command(msg: Any, timeout: float, fds: Any = ()) -> Ack:
        for fd in fds:
            os.close(fd)
        worker.got.append(msg)
        return Ack(0, False, "the copy failed after it began (OSError: [Errno 5] Input/output error); the worker "
                             "restarts from the files and the updates accepted before this one", restarts=True)

    worker.command = command  # type: ignore[method-assign]
    return worker


async def test_a_live_update_a_worker_failed_half_way_through_is_unavailable_not_refused() -> None:
    """Not a 400 on ``tensors`` (a trainer stops on that), but a 503: nothing of it is in force on
    that worker, send it again. Where another worker of the model took it, it is still a 409 split."""
    from diffusiond.daemon.edge.status import status_of
    from diffusiond.daemon.errors import Unavailable, UpdateSplit

    live, loras = LiveComponents(), LiveLoras(LoraRegistry({}, 3))
    model = FakeModel("tiny", [half_applied(FakeWorker("w0"))])
    for send in (lambda: component_update(live, model), lambda: lora_update(loras, "trainer", [model])):
        with pytest.raises(Unavailable) as err:
            await send()
        assert status_of(err.value) == 503 and err.value.code == "unavailable" and err.value.retry_after_s == 5
        message = err.value.message
        assert "update version 1 was not applied: w0 failed while copying it: the copy failed after it began" \
            in message, message
        assert "nothing of version 1 is in force on that worker" in message and "send the update again" in message
    assert live.kept == {} and loras.kept == {}
    with pytest.raises(UpdateSplit) as split:
        await component_update(live, two_workers(half_applied(FakeWorker("w1"))))
    assert status_of(split.value) == 409 and "applied by 1 of 2 workers" in split.value.message
