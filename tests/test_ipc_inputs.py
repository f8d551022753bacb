"""Edits' input buffers (``ipc/inputs.py``): what the worker reads is what the engine validated,
and the pixels travel by fd, never in a frame."""

from __future__ import annotations

import os

import numpy as np
import pytest

from diffusiond.ipc.arena import memfd
from diffusiond.ipc.errors import ArenaError
from diffusiond.ipc.frames import FrameEncoder
from diffusiond.ipc.inputs import InputBuffer, read_inputs
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
