"""A model's parameter table (issue 29): what a worker reports of the model it loaded, remembered in the state
dir, and checked by the engine for a model that runs no worker in the worker's words, whatever its files.

In process for the words (the table against the worker's own checks on the same loaded tiny) and for the
fingerprint; a real daemon (``--preload none``, a state dir kept across restarts) for what a trainer sees:
after tiny ran once, an update the headers cannot judge is refused at once, also after a restart, and a
changed spec leaves the stale table unused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from daemonkit import Daemon, http, submit, wait_job
from test_live_refusals import tiny_entry, to_disk

import diffusiond
import diffusiond.daemon.state.params as params
from diffusiond.client import AsyncClient, DaemonError
from diffusiond.client.weights import pack as pack_update
from diffusiond.daemon.core.file_checks import FileChecks, ModelFiles, ModelTable
from diffusiond.daemon.model_config import ModelConfig
from diffusiond.daemon.state.params import ParamTables
from diffusiond.ipc.frames import Frame
from diffusiond.ipc.messages import Kind, UpdateLora, UpdateWeights, WeightTensor
from diffusiond.ipc.params import ParamTableFrame, pack, unpack
from diffusiond.pipelines.hotswap import adapters_for
from diffusiond.pipelines.loras import unsupported
from diffusiond.pipelines.preset_tables import PRESETS
from diffusiond.pipelines.registry import load_pipeline
from diffusiond.worker.weights import apply_update, apply_weights, param_table


@pytest.fixture(scope="module")
def tiny(model_cache: Path) -> Any:
    return load_pipeline("tiny", name="tiny", device="cpu", dtype="float32")


def _applied(pipe: Any, component: str, state: dict[str, torch.Tensor]) -> tuple[str, list[WeightTensor]]:
    """``state`` sent to the worker's update of ``component`` as a client sends it (its sealed memfds): the worker's
    answer ('' when applied) and the header the engine's table is asked about."""
    fds, tensors = pack_update(state)
    try:
        return apply_weights(pipe, UpdateWeights("tiny", component, tensors), fds), tensors
    finally:
        for fd in fds:
            os.close(fd)


def _first(component: torch.nn.Module, kind: type) -> tuple[str, torch.nn.Module]:
    return next((n, m) for n, m in component.named_modules() if type(m) is kind)


def test_the_table_refuses_what_the_worker_refuses_in_the_same_words(tiny: Any) -> None:
    adapters = adapters_for(tiny, {}, 2)
    assert adapters is not None
    table = ModelTable("tiny", unpack(pack(param_table(tiny, adapters))))
    unet = tiny.pipe.unet
    conv_out = unet.conv_out.weight
    weights = [("unet", {"conv_out.weight": torch.zeros(3, *conv_out.shape[1:])}),
               ("unet", {"conv_out.nope": conv_out.detach()}),
               ("text_encoder", {"nope.weight": conv_out.detach()}),  # a name the headers cannot judge
               ("transformer", {"x.weight": conv_out.detach()}),
               ("unet", {"conv_out.weight": conv_out.detach().clone()})]  # fits: '' from both
    for component, state in weights:
        worker, tensors = _applied(tiny, component, state)
        assert table.weights_misfit(component, tensors) == worker, (component, state.keys(), worker)
    linear, lin = _first(unet, torch.nn.Linear)
    conv, cv = _first(unet, torch.nn.Conv2d)
    assert isinstance(lin, torch.nn.Linear) and isinstance(cv, torch.nn.Conv2d)

    def pair(path: str, a: tuple[int, ...], b: tuple[int, ...]) -> dict[str, torch.Tensor]:
        return {f"{path}.lora_A.weight": torch.ones(a), f"{path}.lora_B.weight": torch.ones(b)}

    loras = [pair("unet.conv_norm_out", (2, 32), (32, 2)),  # a norm: the header shows a weight, not its class
             pair(f"unet.{linear}", (2, lin.in_features + 1), (lin.out_features, 2)),
             pair(f"unet.{conv}", (2, cv.in_channels, *cv.kernel_size), (cv.out_channels + 1, 2, 1, 1)),
             pair("unet.nope", (2, 4), (4, 2)),
             pair("transformer.x", (2, 4), (4, 2))]
    for state in loras:
        worker = apply_update(adapters, "tiny", UpdateLora("live", [], 1), state)
        assert worker, state.keys()
        assert table.lora_misfit("live", {k: tuple(v.shape) for k, v in state.items()}) == worker
    fits = pair(f"unet.{linear}", (2, lin.in_features), (lin.out_features, 2))
    assert table.lora_misfit("live", {k: tuple(v.shape) for k, v in fits.items()}) == ""
    no_lora = ModelTable("tiny", unpack(pack(param_table(tiny, None))))  # a model that takes no LoRA at all
    assert no_lora.lora_misfit("live", {k: tuple(v.shape) for k, v in fits.items()}) == unsupported(tiny)


def test_update_weights_under_sequential_offload_is_refused_not_lost(model_cache: Path) -> None:
    """Accelerate's ``cpu_offload`` (what ``enable_sequential_cpu_offload`` puts on each component)
    leaves the parameters on the meta device and keeps the weights in its hooks; a copy into them wrote
    nowhere, raised nothing, and the update was versioned. The worker, its table and the files refuse it
    in one wording; a component without the hook still takes updates."""
    from accelerate import cpu_offload

    from diffusiond.daemon.core.file_checks import Component

    pipe = load_pipeline("tiny", name="tiny", device="cpu", dtype="float32")  # its own: the hook stays on it
    unet = pipe.pipe.unet
    cpu_offload(unet, execution_device=torch.device("cpu"))
    assert unet.conv_out.weight.is_meta
    zero = {"conv_out.weight": torch.zeros(unet.conv_out.weight.shape)}
    tensors = [WeightTensor("conv_out.weight", "float32", list(unet.conv_out.weight.shape), 0)]
    before = unet.conv_out._hf_hook.weights_map["weight"].clone()
    why, tensors = _applied(pipe, "unet", zero)
    assert why.startswith("unet of model tiny runs with offload=sequential") and "offload=model, group or none" in why
    assert torch.equal(unet.conv_out._hf_hook.weights_map["weight"], before)
    table = ModelTable("tiny", unpack(pack(param_table(pipe, None))))
    assert table.weights_misfit("unet", tensors) == why  # the engine refuses at once for a model with no worker
    files = ModelFiles("tiny", {"unet": Component(True, {"conv_out.weight": ("F32", tuple(tensors[0].shape))})},
                       sequential=True)
    assert files.weights_misfit("unet", tensors) == why  # and before the model ever loaded
    vae = pipe.pipe.vae
    with torch.no_grad():
        vae.decoder.conv_out.bias.fill_(1.0)
    fds, fitting = pack_update({"decoder.conv_out.bias": torch.zeros(vae.decoder.conv_out.bias.shape)})
    try:
        assert apply_weights(pipe, UpdateWeights("tiny", "vae", fitting), fds) == ""
    finally:
        for fd in fds:
            os.close(fd)
    assert not vae.decoder.conv_out.bias.any()


async def test_a_table_is_used_only_for_the_spec_options_and_files_it_was_made_from(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model_index.json").write_text("{}")
    tables = ParamTables(tmp_path / "state")
    made = ModelConfig(name="m", spec=str(folder))
    packed = pack(param_table(type("P", (), {"pipe": None})(), None))
    key = tables.key(made)
    assert key is not None
    tables.save("m", key, packed)
    assert ParamTables(tmp_path / "state").load("m", key) == packed  # kept across a restart
    assert isinstance(await FileChecks({"m": made}, tables)("m"), ModelTable)  # and it answers
    for other in (ModelConfig(name="m", spec=str(folder), options={"fuse_qkv": "1"}),
                  ModelConfig(name="m", spec=str(folder), dtype="float16"),
                  ModelConfig(name="m", spec="tiny")):
        assert tables.key(other) != key, other
    os.utime(folder / "model_index.json", ns=(1, 1))  # the files changed since: their headers answer
    assert tables.key(made) != key
    assert tables.load("m", tables.key(made) or "") is None
    # a single file's configs come from its config= folder, whose files count as its own
    (tmp_path / "one.safetensors").write_bytes(b"x")
    single = ModelConfig(name="s", spec=f"{tmp_path / 'one.safetensors'},config={folder}")
    before = tables.key(single)
    os.utime(folder / "model_index.json", ns=(2, 2))
    assert before is not None and tables.key(single) != before
    assert isinstance(await FileChecks({"m": made}, tables)("m"), ModelFiles)
    # a file that does not read is no table
    next((tmp_path / "state" / "params").iterdir()).write_bytes(b"not msgpack")
    assert tables.load("m", key) is None


def test_a_table_is_used_only_with_the_same_software_and_preset_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table made without peft (which refuses every LoRA), or under another diffusers or
    diffusiond release, or from an earlier revision of a ``random:`` preset, does not answer for this one."""
    tables = ParamTables(None)
    made = ModelConfig(name="m", spec="random:ltx-2")
    key = tables.key(made)
    assert key is not None and key == tables.key(made)
    versions = dict(params.software())
    for name, other in (("peft", "absent" if versions["peft"] != "absent" else "0.17.0"), ("diffusers", "0.0.1"),
                        ("torch", "0.0.1"), ("transformers", "0.0.1")):
        monkeypatch.setattr(params, "software", lambda n=name, v=other: {**versions, n: v})
        assert tables.key(made) != key, name
    monkeypatch.setattr(params, "software", lambda: versions)
    assert tables.key(made) == key
    monkeypatch.undo()
    monkeypatch.setattr(diffusiond, "__version__", "0.0.1")
    assert tables.key(made) != key, "diffusiond's own version"
    monkeypatch.undo()
    monkeypatch.setattr(params, "TABLE_REVISION", params.TABLE_REVISION + 1)  # a checkout's own code changed
    assert tables.key(made) != key, "the tables' revision"
    monkeypatch.undo()
    monkeypatch.setitem(PRESETS, "ltx-2", dataclasses.replace(PRESETS["ltx-2"], revision=2))
    assert tables.key(made) != key, "the preset's revision"


async def test_a_table_that_comes_while_the_files_are_read_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load's PARAM_TABLE that arrives while an update's check reads the model's files (a
    hub folder's take a while) is what answers, then and for the rest of the run, not the files' older word."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model_index.json").write_text("{}")
    checks = FileChecks({"m": ModelConfig(name="m", spec=str(folder))}, ParamTables(None))
    reading, go_on = threading.Event(), threading.Event()
    find = checks._find

    def slow(config: ModelConfig) -> Any:
        reading.set()
        go_on.wait(30)
        return find(config)

    monkeypatch.setattr(checks, "_find", slow)
    asking = asyncio.ensure_future(checks("m"))
    assert await asyncio.to_thread(reading.wait, 30)
    table = pack(param_table(type("P", (), {"pipe": None})(), None))
    checks.watching(lambda *_: None)(None, Frame(Kind.PARAM_TABLE, 0, ParamTableFrame("m", table)))  # type: ignore[arg-type]
    assert isinstance(await checks("m"), ModelTable)  # once the table is kept
    go_on.set()
    assert isinstance(await asking, ModelTable)
    assert isinstance(await checks("m"), ModelTable)


async def test_a_misspelt_preset_has_no_table_and_every_update_gets_an_answer() -> None:
    """``random:nope`` raised out of the fingerprint, the update's task died and the trainer (no
    timeout by default) waited forever. Serve refuses the name at start now (test_newcomer.py); here, what the update
    path does with it or with any failure it did not foresee: it answers."""
    from diffusiond.daemon.edge.handoff import _Connection
    from diffusiond.pipelines.errors import PipelineError

    assert ParamTables(None).key(ModelConfig(name="b", spec="random:nope")) is None
    posted: list[Any] = []
    failure: list[Exception] = []

    async def update(*_: Any) -> int:
        raise failure[0]

    engine = type("E", (), {"config": type("C", (), {"worker_start_timeout_s": 1.0})(), "models": lambda self: [],
                            "live_loras": type("L", (), {"update": staticmethod(update)})()})()
    connection = _Connection(type("S", (), {"engine": engine})(), type("Ch", (), {"post": posted.append})())  # type: ignore[arg-type]
    for failure[:], status, code in (([PipelineError("unknown preset 'random:nope'")], 400, "invalid_request"),
                                     ([RuntimeError("a bug")], 500, "internal_error")):
        await connection._update(UpdateLora("trainer", []), [])
        answer = posted.pop()
        assert (answer.name, answer.status, answer.code) == ("trainer", status, code), answer


SMALL = {"model": "tiny", "width": 64, "height": 64, "steps": 1, "prompt": "a lighthouse", "seed": 1,
         "output_format": "npy"}
NORM = {"unet.conv_norm_out.lora_A.weight": np.ones((2, 32), np.float32),  # headers cannot judge it
        "unet.conv_norm_out.lora_B.weight": np.ones((32, 2), np.float32)}
NORM_WORDS = "module 'conv_norm_out' of unet is a GroupNorm, which takes no LoRA"


async def refused(call: Any, words: str) -> None:
    with pytest.raises(DaemonError) as err:
        await call
    assert err.value.status == 400 and words in str(err.value), err.value


async def test_a_model_that_ran_before_has_updates_checked_at_once_from_its_table(
        tmp_path: Path, model_cache: Path) -> None:
    from safetensors import safe_open

    from diffusiond.pipelines.tiny import ensure_tiny

    with safe_open(str(ensure_tiny() / "text_encoder" / "model.safetensors"), "np") as f:
        name = next(iter(f.keys()))
        value = f.get_tensor(name)
    state = ["--state-dir", str(tmp_path / "state")]
    args = ["--model", "tiny", "--preload", "none", "--workers", "1", "--job-timeout", "300", *state]
    d = Daemon(tmp_path / "d.sock", args, tmp_path / "d.log",
               env={"DIFFUSIOND_CACHE": str(model_cache), "OMP_NUM_THREADS": "1"})
    d.start()
    try:
        async with AsyncClient(str(d.socket)) as c, http(d.socket) as s:
            job = await wait_job(s, (await submit(s, SMALL))["id"], 300)  # tiny's one run: it reports its table
            assert job["status"] == "succeeded", job
            await to_disk(s)
            await refused(c.update_lora("trainer", NORM), NORM_WORDS)
            await refused(c.update_weights("tiny", "text_encoder", {"nope.weight": value}),
                          "tensor 'nope.weight': text_encoder of model tiny has no parameter of that name")
            assert await c.update_weights("tiny", "text_encoder", {name: value}) == 1  # one that fits is kept
    finally:
        d.stop()
    d.start()  # the same state dir: the table on disk answers, and tiny is not loaded to answer
    try:
        async with AsyncClient(str(d.socket)) as c, http(d.socket) as s:
            await refused(c.update_lora("trainer", NORM), NORM_WORDS)
            assert (await tiny_entry(s))["residency"] == "disk"
    finally:
        d.stop()
    d.args = ["--model", "tiny=tiny,attention=native", *args[2:]]  # another spec under the same name
    d.start()
    try:
        async with AsyncClient(str(d.socket)) as c:
            assert await c.update_lora("trainer", NORM) == 1  # the stale table is not used: kept on trust
    finally:
        d.stop()


class _Quantized(torch.Tensor):
    """A weight held by a tensor subclass, as torchao's quantized weights are (``Int8Tensor``, ``Float8Tensor``):
    they report bfloat16 and hold int8 or float8, so their dtype alone cannot tell they are not plain values."""


def test_a_weight_kept_by_a_tensor_subclass_is_refused_before_anything_is_written(model_cache: Path) -> None:
    """Such a weight passed the check, the copy failed half-way and the worker restarted; now the
    update is refused in the worker's words and in its table's, naming the tensor and what keeps it."""
    pipe = load_pipeline("tiny", name="tiny", device="cpu", dtype="float32")
    unet = pipe.pipe.unet
    bias = unet.conv_out.bias.detach().clone()
    unet.conv_out.weight = torch.nn.Parameter(unet.conv_out.weight.detach().as_subclass(_Quantized),
                                              requires_grad=False)
    state = {"conv_out.bias": torch.ones_like(bias), "conv_out.weight": torch.ones(unet.conv_out.weight.shape)}
    why, tensors = _applied(pipe, "unet", state)
    assert why == ("tensor 'conv_out.weight': unet keeps it as a _Quantized (quantized, or another tensor "
                   "subclass), which is not updated in place: serve the model without its quantization (quant=, "
                   "fp8=) to update this tensor"), why
    assert torch.equal(unet.conv_out.bias, bias)  # refused whole: not even the bias before it
    table = ModelTable("tiny", unpack(pack(param_table(pipe, None))))
    assert table.weights_misfit("unet", tensors) == why
