"""Edits' input buffers (``ipc/inputs.py``): what the worker reads is what the engine validated,
and the pixels travel by fd, never in a frame."""

from __future__ import annotations

import os

import numpy as np
import pytest

from diffusiond.ipc.arena import memfd
from diffusiond.ipc.errors import ArenaError
from diffusiond.ipc.frames import FrameEncoder
from diffusiond.ipc.inputs import InputBuffer, read_controls, read_inputs, read_references
from diffusiond.ipc.messages import BatchParams, Execute, RequestSpec


def test_input_buffer_round_trips_image_and_mask_and_nothing_can_change_it() -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (72, 64, 3), dtype=np.uint8)
    mask = rng.integers(0, 256, (72, 64, 1), dtype=np.uint8)
    buf = InputBuffer(image, mask)
    try:
        fd = buf.dup()
        try:
            got_image, got_mask = read_inputs([fd], buf.ref(0))
            assert np.array_equal(got_image, image) and got_mask is not None and np.array_equal(got_mask, mask)
            with pytest.raises(PermissionError):  # sealed: not even the fd's holder can write
                os.pwrite(fd, b"x", 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 1)
        finally:
            os.close(fd)
    finally:
        buf.close()


@pytest.mark.parametrize("kind", ["edit", "inpaint", "control"])
def test_references_join_an_edits_or_controls_arrays_in_one_new_sealed_buffer(kind: str) -> None:
    """A job's input is one fd: its IP-Adapter references are added to what it had, in a copy."""
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    mask = rng.integers(0, 256, (64, 64, 1), dtype=np.uint8)
    controls = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(2)]
    ref = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
    old = (InputBuffer(None, None, controls=controls, name="diffusiond-control") if kind == "control"
           else InputBuffer(image, mask if kind == "inpaint" else None))
    new = old.with_references([ref])
    old.close()
    try:
        r = new.ref(0)
        assert (r.image is None) == (kind == "control") and (r.mask is None) == (kind != "inpaint")
        assert new.name == ("diffusiond-control" if kind == "control" else "diffusiond-input")
        assert [d.shape for d in r.references] == [(40, 48, 3)]
        assert np.array_equal(read_references([new.fd], r)[0], ref)
        if kind == "control":
            assert all(np.array_equal(a, b) for a, b in zip(read_controls([new.fd], r), controls, strict=True))
        else:
            got_image, got_mask = read_inputs([new.fd], r)
            assert np.array_equal(got_image, image) and (got_mask is None or np.array_equal(got_mask, mask))
        with pytest.raises(PermissionError):
            os.pwrite(new.fd, b"x", 0)
    finally:
        new.close()


def test_worker_refuses_input_memory_that_is_not_sealed() -> None:
    buf = InputBuffer(np.zeros((8, 8, 3), dtype=np.uint8))
    loose = memfd("loose", buf.nbytes)
    try:
        with pytest.raises(ArenaError, match="not sealed"):
            read_inputs([loose], buf.ref(0))
        with pytest.raises(ArenaError, match="fd 3"):
            read_inputs([loose], buf.ref(3))
    finally:
        os.close(loose)
        buf.close()


def test_an_edit_frame_carries_descriptors_not_pixels() -> None:
    buf = InputBuffer(np.zeros((1024, 1024, 3), dtype=np.uint8), np.zeros((1024, 1024, 1), dtype=np.uint8))
    try:
        params = BatchParams(width=1024, height=1024, steps=4, guidance=5.0, edit="inpainting", strength=0.6)
        msg = Execute(1, params, [RequestSpec(request_id=f"j/{k}", prompt="p", seed=k, input=buf.ref(0))
                                  for k in range(4)])
        frame = FrameEncoder().encode(msg, nfds=1)
    finally:
        buf.close()
    # descriptors and the requests' own fields (a few hundred bytes each), three orders of
    # magnitude under one input's 4 MB: the pixels went by fd
    assert len(frame) < 4096, f"{len(frame)} bytes for 4 edits of a 4 MB input"
