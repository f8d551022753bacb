"""The upscale of a cancelled batch stops, and finished upscales wait for the copy smaller (report 30 #9).

Cancelling a 2048² ``n=4`` job with an 8x upscale left its worker busy for minutes: the upscaler ran every tile
of every picture with no check, and held every upscaled picture in float32 (4 bytes a channel) until the copy; a
uint8 output now waits as uint8 (issue 31's extras). The finisher here is the worker's own (worker/finish.py),
on a real ESRGAN file (tests/upscalekit.py) and the worker's shared state, whose cancel arrives while the tiles
run.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from diffusiond.ipc import messages as m
from diffusiond.ipc.upscale import UpscalerSetting, UpscaleSpec
from diffusiond.pipelines.base import Interrupted
from diffusiond.pipelines.upscalers import Upscalers
from diffusiond.worker.copier import to_output_layout
from diffusiond.worker.finish import Finisher
from diffusiond.worker.state import SharedState

REQS = [m.RequestSpec(request_id=f"r{k}", prompt="a fox", seed=k) for k in range(2)]
PARAMS = m.BatchParams(width=64, height=64, steps=2, guidance=5.0,
                       upscale=UpscaleSpec(name="esr", scale=2.0, width=128, height=128))


def _finisher(upscaler_file: Path, state: SharedState, cancel_at: int = 0) -> tuple[Finisher, list[int]]:
    """A finisher over upscaler ``esr`` in tiles of 16 (16 forwards of 4 tiles per 64² picture), counting
    forwards; the batch is cancelled during forward ``cancel_at`` (0: never)."""
    upscalers = Upscalers({"esr": UpscalerSetting(path=str(upscaler_file), tile=16, overlap=4)}, torch.device("cpu"))
    model, forwards = upscalers.models["esr"], []

    def counted(x: torch.Tensor) -> torch.Tensor:
        forwards.append(len(x))
        if len(forwards) == cancel_at:  # the client's cancel arrives while the tiles run
            state.cancel([r.request_id for r in REQS])
        return model(x)  # type: ignore[no-any-return]

    upscalers.models["esr"] = counted
    return Finisher(None, upscalers, state.all_cancelled), forwards  # type: ignore[arg-type]


def _outputs() -> list[torch.Tensor]:
    return [torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(k)) for k in range(len(REQS))]


def test_a_cancel_stops_the_upscale_between_tiles(upscaler_file: Path) -> None:
    state = SharedState()
    state.admit([r.request_id for r in REQS])
    finish, forwards = _finisher(upscaler_file, state, cancel_at=3)
    with pytest.raises(Interrupted):
        finish(PARAMS, REQS, _outputs(), lambda _s, _t: True, None)
    assert len(forwards) == 3, f"{len(forwards)} forwards ran after the cancel"


def _half_hand_off(picture: torch.Tensor) -> torch.Tensor:
    """How an upscaled uint8 output waited before it waited as uint8: in float16, rounded to its 256 levels."""
    return (picture.float().clamp(0, 1) * 255).round().div(255).to(torch.float16)


@pytest.mark.parametrize(("output_dtype", "dtype"), [("uint8", torch.float32), ("uint8", torch.bfloat16),
                                                     ("uint8", torch.float16), ("float32", torch.float32)])
def test_upscaled_outputs_wait_as_uint8_and_copy_as_before(upscaler_file: Path, output_dtype: str,
                                                           dtype: torch.dtype) -> None:
    """For a uint8 output the picture waits at its 256 levels as uint8, a quarter of float32's bytes: the copy's
    bytes are those of the picture in the model's dtype, and of the float16 hand-off before, bit for bit. A
    float output keeps the model's dtype."""
    finish, _ = _finisher(upscaler_file, SharedState())
    params = msgspec.structs.replace(PARAMS, output_dtype=output_dtype)
    outputs = [out.to(dtype) for out in _outputs()]
    with torch.inference_mode():
        got = finish(params, REQS, outputs, lambda _s, _t: True, None)
        assert finish.upscalers is not None
        want = [finish.upscalers.upscale("esr", out[None])[0].to(dtype) for out in outputs]
    assert {g.dtype for g in got} == {torch.uint8 if output_dtype == "uint8" else dtype}
    for g, w in zip(got, want, strict=True):
        sent = to_output_layout(g, output_dtype).numpy()
        assert np.array_equal(sent, to_output_layout(w, output_dtype).numpy())
        if output_dtype == "uint8":
            assert np.array_equal(sent, to_output_layout(_half_hand_off(w), output_dtype).numpy())
            if torch.cuda.is_available():  # the device path of the copy: the same bytes
                assert np.array_equal(sent, to_output_layout(g.cuda(), output_dtype).cpu().numpy())
