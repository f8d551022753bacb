"""The room's books against what the workers really hold, where they came apart: a pressure poll taken
while a load's workers were still starting made its bytes free twice; a lost worker's replacement came back into
room another model had taken meanwhile; a model on two devices sent away models from the one that had room; and
``offload=auto`` chose a configuration that residency then refused, for a model with two workers on one GPU or
beside a pinned model.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from residencykit import Engine, G, S

from diffusiond.daemon.config import build_config
from diffusiond.daemon.residency.decisions import Evict, Fits, Move, TooLarge, Wait
from diffusiond.daemon.residency.fit import device_weights, fit
from diffusiond.daemon.residency.policy import Residency


def test_a_poll_while_a_load_starts_leaves_its_bytes_booked() -> None:
    """Another program holds 12 GiB of a 24 GiB card; two 8 GiB models may not both load into the 11 GiB left."""
    r = Residency({"cuda:0": 20 * G}, 0)
    r.add("a", "cuda:0", 8 * G)
    r.add("b", "cuda:0", 8 * G)
    r.pressure("cuda:0", 12 * G, G)
    assert isinstance(r.plan("a", None), Fits)
    r.loading_started("a")
    assert isinstance(r.plan("b", None), Wait)
    r.pressure("cuda:0", 12 * G, G)  # a's workers are still starting: the reading shows none of its bytes
    assert isinstance(r.plan("b", None), Wait), "b planned into the bytes booked for a"
    r.loaded("a", now=1)
    r.pressure("cuda:0", 4 * G, G)  # a's 8 GiB allocated now
    plan = r.plan("b", None)
    assert isinstance(plan, Evict) and [mv.model for mv in plan.moves] == ["a"], "room only once idle a leaves"


def test_a_poll_while_a_model_leaves_counts_its_bytes_once() -> None:
    """Its worker may have stopped before the poll (the reading shows the bytes free) or not: either way they are
    free once, when the move ends."""
    r = Residency({"cuda:0": 30 * G}, 0)
    r.add("a", "cuda:0", 8 * G)
    r.add("b", "cuda:0", 20 * G)
    r.add("c", "cuda:0", 4 * G)
    e = Engine(r)
    e.run("a")
    r.pressure("cuda:0", 12 * G, G)  # 11 GiB beyond the reserve, a's 8 GiB held
    (move,) = r.evict("a", "by hand").moves
    r.unloading(move)
    r.pressure("cuda:0", 20 * G, G)  # a's worker has stopped already
    r.unloaded(move)
    assert isinstance(r.plan("b", None), Wait), "a's 8 GiB counted twice: 27 GiB of room where 19 are free"
    assert isinstance(r.plan("c", None), Fits)


def test_a_lost_workers_copy_stays_booked_until_its_replacement_is_back() -> None:
    r = Residency({"cuda:0": 10 * G, "cuda:1": 10 * G}, 0)
    r.add("a", ("cuda:0", "cuda:1"), 6 * G)
    r.add("b", "cuda:0", 6 * G)
    e = Engine(r)
    e.run("a")
    r.worker_died("a", "cuda:0", "killed by SIGSEGV")  # the pool replaces it, asking nobody
    assert r.snapshot()[0].per_device == {"cuda:0": 0, "cuda:1": 6 * G}, "what it holds"
    assert r.device_used("cuda:0") == 6 * G, "what the budget counts: the replacement's copy"
    r.queue("b")
    assert not isinstance(r.plan("b", S), Fits), "b would load into the room the replacement takes back"
    r.worker_back("a", "cuda:0")
    assert r.device_used("cuda:0") == 6 * G <= r.budgets["cuda:0"]
    r.worker_died("a", "cuda:0", "killed")
    r.worker_died("a", "cuda:1", "killed")  # the last: on disk, nothing held or booked
    assert r.tier("a") == "disk" and r.device_used("cuda:0") == r.device_used("cuda:1") == 0


def test_a_model_on_two_devices_sends_away_only_what_frees_the_one_short_of_room() -> None:
    r = Residency({"cuda:0": 10 * G, "cuda:1": 10 * G}, 0)
    for name, device, nbytes in (("c0", "cuda:0", 5 * G), ("c1", "cuda:1", 5 * G), ("big", "cuda:1", G)):
        r.add(name, device, nbytes)
        r.measured(name, S, G // 4)
    r.add("m", ("cuda:0", "cuda:1"), 4 * G)
    r.measured("m", S, G // 4)
    e = Engine(r)
    for name in ("c0", "c1", "big"):  # c0 used longest ago, on cuda:0, which has room for m
        e.run(name)
    r.queue("m")
    plan = r.plan("m", S)
    assert isinstance(plan, Evict) and [(mv.model, mv.dst) for mv in plan.moves] == [("c1", "disk")], plan
    e.move(plan.moves)
    assert r.tier("c0") == "device" and isinstance(r.plan("m", S), Fits)


def test_moves_off_a_device_under_a_run_are_refused() -> None:
    r = Residency({"cuda:0": 10 * G}, 0)
    r.add("a", "cuda:0", 4 * G)
    Engine(r).run("a")
    r.queue("a")
    r.start("a", S, now=1)
    with pytest.raises(RuntimeError, match="under 1 run"):
        r.unloading(Move("a", "device", "disk", "a decision made before the run"))


def _folder(root: Path, blocks: int) -> Path:
    """An SD3-layout folder whose files are headers over holes (sparse): ``blocks`` x 128 MiB of transformer and
    256 MiB of text encoder in bf16, sized by ``fit`` as real files are, written in milliseconds."""
    def write(path: Path, shapes: dict[str, list[int]]) -> None:
        header, offset = {}, 0
        for name, shape in shapes.items():
            nbytes = shape[0] * shape[1] * 2
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        path.parent.mkdir(parents=True)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)

    root.mkdir()
    (root / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline", "transformer": [
        "diffusers", "SD3Transformer2DModel"], "text_encoder": ["transformers", "CLIPTextModelWithProjection"]}))
    write(root / "transformer" / "diffusion_pytorch_model.safetensors",
          {f"transformer_blocks.{i}.ff.weight": [8192, 8192] for i in range(blocks)} | {"proj_out.weight": [8192, 64]})
    write(root / "text_encoder" / "model.safetensors", {f"layers.{i}.w.weight": [4096, 4096] for i in range(8)})
    return root


def _needs(folder: Path, name: str) -> int:
    """What ``offload=auto`` counts for configuration ``name``: its weights and a 1024² image's working memory."""
    return next(c.needs for c in fit(str(folder), budget=2**50).configurations if c.name == name)


def test_auto_plans_each_of_two_workers_on_one_gpu_in_its_share_of_the_budget(tmp_path: Path) -> None:
    """Residency counts a copy per worker: auto chose ``none`` for one copy in the whole budget, and every job
    was refused though an offloaded configuration fits twice."""
    folder = _folder(tmp_path / "m", 48)
    budget = _needs(folder, "none") + G // 2
    one = build_config({}, {"model": [f"m={folder}"], "device_memory": str(budget), "device": "cuda:0"})
    assert one.models[0].options["offload"] == "none"
    two = build_config({}, {"model": [f"m={folder}"], "device_memory": str(budget), "device": "cuda:0,cuda:0"})
    m = two.models[0]
    assert m.options["offload"] == "group" and not m.nothing_fits, m.offload_reason
    r = Residency({"cuda:0": budget}, 0)
    r.add("m", m.devices, device_weights(m.spec, m.options, m.dtype, on_cpu=False) or 0)
    assert not isinstance(r.plan("m", None), TooLarge)


def test_auto_leaves_room_for_a_model_pinned_on_the_same_device(tmp_path: Path) -> None:
    pinned, folder = _folder(tmp_path / "p", 64), _folder(tmp_path / "m", 48)
    budget = _needs(folder, "none") + 3 * G
    config = build_config({}, {"model": [f"p={pinned}", f"m={folder}"], "pin": ["p"], "device_memory": str(budget),
                               "device": "cuda:0"})
    p, m = config.models
    assert p.options["offload"] == "none", p.offload_reason
    assert m.options["offload"] == "group" and not m.nothing_fits, m.offload_reason
    r = Residency({"cuda:0": budget}, 0)
    r.add("p", "cuda:0", device_weights(p.spec, p.options, p.dtype, on_cpu=False) or 0, pinned=True)
    r.add("m", "cuda:0", device_weights(m.spec, m.options, m.dtype, on_cpu=False) or 0)
    Engine(r).run("p")
    assert not isinstance(r.plan("m", None), TooLarge)
