"""What offloaded models keep in host memory counts against --host-memory (report 28 #5).

Under offload=group/model/sequential/stream a model "on the device" keeps most of its weights in host memory
(pinned for group and stream): FLUX under group keeps about 34 GB there. The room counted only the host tier,
at the device figure, so a host budget could be overcommitted by tens of GB. A CPU daemon cannot offload, so
the worker's side is checked by counting a tiny FLUX pipeline with ``offload.host_bytes`` against ``fit``'s
figures from the same files (stream applied for real on the CPU, the other modes' rule read off the modules).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fluxkit import build_flux
from residencykit import Engine, G, room, tier

import diffusiond.pipelines.offload as offload
from diffusiond.daemon.residency.fit import fit
from diffusiond.pipelines.streaming import BlockStreamer


def _offloaded_room(host: int) -> Engine:
    """a and b resident (4 GiB each); big offloaded: 2 GiB on the device, 6 GiB waiting in host memory."""
    r = room(budget=7 * G, host=host, models={"a": 4 * G, "b": 4 * G})
    r.add("big", "cuda:0", 2 * G, host_bytes=6 * G)
    r.measured("big", next(iter(r.measurements.peaks("a", 4 * G))), G)
    return Engine(r)


def test_an_offloaded_model_on_its_device_counts_its_host_share_and_leaves_less_host_room() -> None:
    e = _offloaded_room(host=9 * G)
    e.run("a")
    e.run("big")
    assert tier(e.r, "big") == "device" and e.r.host_used() == 6 * G  # before: 0
    snap = {s.name: s for s in e.r.snapshot()}
    assert snap["big"].host_bytes == 6 * G and snap["big"].device_bytes == 2 * G
    e.run("b")  # a leaves the device: 3 GiB of host room left beside big's 6, too little for a's 4
    assert tier(e.r, "a") == "disk" and e.r.host_used() == 6 * G
    leave = next(mv for mv in e.moves if mv.model == "a")
    assert leave.dst == "disk" and "no room for it in host memory (3.00 GiB free of 9.00 GiB)" in leave.reason


def test_an_offloaded_model_sent_to_host_counts_its_whole_size_and_frees_it_all_on_disk() -> None:
    e = _offloaded_room(host=9 * G)
    e.run("big")
    e.run("a")
    e.run("b")  # big (least recent) goes to host memory whole: its 2 GiB join its 6
    assert tier(e.r, "big") == "host" and e.r.host_used() == 8 * G
    assert {s.name: s.host_bytes for s in e.r.snapshot()}["big"] == 8 * G
    e.run("a")  # b leaves the device for host memory, which must drop big, all 8 GiB of it, to disk
    assert (tier(e.r, "big"), tier(e.r, "b")) == ("disk", "host") and e.r.host_used() == 4 * G
    e.run("big")  # back from disk, its 6 GiB host share needs room: b (4 of 5 GiB used) drops to disk first
    assert tier(e.r, "b") == "disk" and e.r.host_used() == 6 * G
    drop = next(mv for mv in reversed(e.moves) if mv.model == "b")
    assert drop.dst == "disk" and "big, offloaded, keeps 6.00 GiB there while it runs" in drop.reason


def test_the_workers_count_replaces_the_estimate_host_share_included() -> None:
    e = _offloaded_room(host=20 * G)
    e.r.resize("big", 3 * G, 5 * G)
    e.run("big")
    assert e.r.host_used() == 5 * G and e.r.device_used("cuda:0") == 3 * G
    e.r.resize("big", 3 * G)  # a model loaded resident holds nothing in host memory
    assert e.r.host_used() == 0
    with pytest.raises(ValueError, match="host bytes -1 is negative"):
        e.r.add("odd", "cuda:0", G, host_bytes=-1)


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_flux(tmp_path_factory.mktemp("flux") / "flux")


def test_the_worker_counts_what_each_offload_keeps_in_host_memory_as_fit_does(flux: Path) -> None:
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(flux), torch_dtype=torch.float32)
    rows = {c.name: c for c in fit(str(flux), dtype="float32", working=0).configurations}
    total = rows["group"].host_bytes
    assert offload.host_bytes(pipe, "none") == 0
    for mode in ("model", "group", "sequential"):  # every weight waits in host memory between forwards
        assert 0 <= offload.host_bytes(pipe, mode) - rows[mode].host_bytes <= 2 * 77 * 8, mode  # buffers
    stream = rows["stream"]
    assert stream.resident_blocks is not None
    BlockStreamer(pipe.transformer, "cpu", stream.resident_blocks)
    assert 0 <= offload.host_bytes(pipe, "stream") - stream.host_bytes <= 2 * 77 * 8
    assert 0 < stream.host_bytes < total
    meta = torch.nn.Linear(64, 64, device="meta")  # sequential's modules: tensors without storage each count
    assert offload._bytes([meta.weight, meta.bias], set()) == (64 * 64 + 64) * 4
