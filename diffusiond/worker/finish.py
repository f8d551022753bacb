"""After a batch's forward, before the copy thread takes its outputs: the hires pass, then the upscaler.

Both run on the compute thread, on the device the outputs are already on, so the copy thread still
gets one finished tensor per request and the output path is the same as for any job.

The hires pass (A1111's "hires fix") makes the first pass's picture larger, with an upscaler when
the request names one, else a bicubic resize of the decoded picture, and runs the model's own
image-to-image pipeline on it (built on the loaded weights with ``from_pipe``, as edits are), so
the model redraws the detail the small picture could not hold. Its steps continue the job's
progress: the first pass reports ``k`` of ``steps + hires.steps``, the second ``steps + k``; its
previews go out with those step numbers too.

An upscaler's own scale is fixed by its weights (ESRGAN x4, say); a request for another scale is
the model's output resized to the asked size (bicubic, antialiased when it shrinks), as ComfyUI's
"upscale image by" after a model does.

An upscaler that runs out of memory (its tiles too large for what the device has left) is retried
once at once with tiles of half the side, after emptying the allocator's cache: cheaper than the
compute thread's own retry, which runs the whole forward again. When that runs out too, the error
goes on to that retry and then fails the job with ``out_of_memory``, its message naming the
upscaler and the tiles tried.

A cancelled batch stops its upscale: before each picture and each forward of tiles the finisher asks
whether every request it was handed is cancelled (``cancelled``, the worker's shared state: the batch, or
the half of it an out-of-memory retry runs, whose cancel then ends that half alone), and if so stops as a
cancelled denoising loop does (``Interrupted``), rather than keeping the device busy for
minutes on outputs nobody will read. Each upscaled output is made smaller as soon as it is done
(``_held``), so a batch of large upscales does not hold every picture in float32 until the copy.

Both make a picture of levels, which a NaN first pass would turn into black pixels (the hires pass's input, an
upscaled uint8 output) that pass for a result. An output that is not finite skips them and goes to the copy as it
is, which fails its request with the reason (``copier.NOT_FINITE``); the others go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import torch
import torch.nn.functional as F

from diffusiond.ipc.messages import BatchParams, RequestSpec
from diffusiond.pipelines.base import (
    EditArrays,
    EditingPipeline,
    Interrupted,
    Pipeline,
    PipelineError,
    PreviewSink,
    StepCallback,
)
from diffusiond.pipelines.controlnet import eager, plain_base
from diffusiond.pipelines.upscalers import Upscalers
from diffusiond.protocol import Task
from diffusiond.worker.copier import finite_or_assumed, to_uint8
from diffusiond.worker.failures import first_line, is_oom

log = logging.getLogger(__name__)

Redraw = Callable[[BatchParams, Sequence[RequestSpec], Sequence[EditArrays], StepCallback, PreviewSink | None],
                  list[torch.Tensor]]
"""What runs a hires pass: the model's ``edit``, or the IP-Adapters' ``run`` with the batch's reference."""


def resize(images: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """(N, C, H, W) in [0, 1] to ``width`` x ``height``, bicubic; unchanged when already that size."""
    if images.shape[-2:] == (height, width):
        return images
    out = F.interpolate(images.float(), size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return out.clamp_(0, 1)


def first_pass(on_step: StepCallback, params: BatchParams) -> StepCallback:
    """The first pass's step callback: its totals count the hires steps still to come."""
    if params.hires is None:
        return on_step
    extra = params.hires.steps
    return lambda step, total: on_step(step, total + extra)


def first_pass_previews(sink: PreviewSink, params: BatchParams) -> PreviewSink:
    """The first pass's previews, numbered as its progress is."""
    if params.hires is None:
        return sink
    extra = params.hires.steps
    return lambda step, total, pictures: sink(step, total + extra, pictures)


class Finisher:
    """What a batch's ``hires`` and ``upscale`` ask of its outputs (nothing when it asks neither)."""

    def __init__(self, pipeline: Pipeline, upscalers: Upscalers | None,
                 cancelled: Callable[[list[str]], bool] | None = None) -> None:
        self.pipeline = pipeline
        self.upscalers = upscalers
        self.oom_retries = 0  # counted, so the compute thread does not report a peak that ran out as a need
        self.cancelled = cancelled or (lambda _ids: False)  # the worker's ``SharedState.all_cancelled``

    def __call__(self, params: BatchParams, requests: Sequence[RequestSpec], outputs: list[torch.Tensor],
                 on_step: StepCallback, on_preview: PreviewSink | None,
                 redraw: Redraw | None = None) -> list[torch.Tensor]:
        """``redraw`` runs the hires pass in place of the model's own ``edit`` (an IP-Adapter batch's:
        the adapter is in the UNet, which then wants the reference on every forward)."""
        ids = [r.request_id for r in requests]
        done = params.steps + (params.hires.steps if params.hires is not None else 0)

        def check() -> None:
            if self.cancelled(ids):
                raise Interrupted(done, done)

        with torch.inference_mode():
            if params.hires is not None:
                ok = finite_or_assumed(outputs)  # the whole batch redraws, its references aligned with it
                hired = self._hires(params, requests, outputs, on_step, on_preview, redraw, check)
                outputs = [big if fine else out for out, big, fine in zip(outputs, hired, ok, strict=True)]
            u = params.upscale
            if u is not None:
                ok = finite_or_assumed(outputs)
                outputs = [_held(resize(self._model(u.name, out[None], check), u.width, u.height)[0], out.dtype,
                                 params.output_dtype) if fine else out for out, fine in zip(outputs, ok, strict=True)]
        return outputs

    def _model(self, name: str, images: torch.Tensor, check: Callable[[], None] | None = None) -> torch.Tensor:
        """The upscaler, retried in smaller tiles when it runs out of memory; ``check`` runs before each
        forward (it raises when the batch is cancelled). Only the message of the first failure is kept:
        the exception's frames hold the tiles and the output being blended, which the retry needs freed."""
        if self.upscalers is None:
            raise PipelineError(f"upscaler {name!r} is not served by this worker")
        try:
            return self.upscalers.upscale(name, images, between=check)
        except Exception as exc:
            if not is_oom(exc):
                raise
            why = first_line(exc)
        self.oom_retries += 1
        tile = self.upscalers.last_tiles(name)[0]  # serve's, or the smaller ones free memory chose
        h, w = images.shape[-2:]
        tiled = bool(tile) and max(h, w) > tile
        ran = f"tiles of {tile}" if tiled else "one piece"
        retry = self.upscalers.smaller(name, images)
        self._empty_cache()
        if retry is None:
            raise torch.OutOfMemoryError(f"upscaler {name!r} ran out of memory on a {w}x{h} picture in {ran} "
                                         f"(no tile smaller than {tile if tiled else max(h, w)} to retry with): {why}")
        log.warning("upscaler %r ran out of memory on a %dx%d picture in %s; retrying in tiles of %d "
                    "(overlap %d): %s", name, w, h, ran, retry[0], retry[1], why)
        try:
            return self.upscalers.upscale(name, images, retry, between=check)
        except Exception as exc:
            if not is_oom(exc):
                raise
            why = first_line(exc)
        self._empty_cache()
        raise torch.OutOfMemoryError(
            f"upscaler {name!r} ran out of memory on a {w}x{h} picture in {ran}, and again in tiles of {retry[0]}: "
            f"{why} (serve it with smaller tiles: --upscaler {name}=PATH,tile=N)")

    def _empty_cache(self) -> None:
        if self.upscalers is not None and self.upscalers.device.type == "cuda":
            torch.cuda.empty_cache()

    def _hires(self, params: BatchParams, requests: Sequence[RequestSpec], outputs: list[torch.Tensor],
               on_step: StepCallback, on_preview: PreviewSink | None, redraw: Redraw | None,
               check: Callable[[], None]) -> list[torch.Tensor]:
        h = params.hires
        assert h is not None
        if redraw is None and not isinstance(self.pipeline, EditingPipeline):
            raise PipelineError(f"model {self.pipeline.name} has no image-to-image pipeline for a hires pass")
        pictures = []
        for out in outputs:
            big = resize(self._model(h.upscaler, out[None], check) if h.upscaler else out[None], h.width, h.height)
            pictures.append((big[0] * 255).round_().to(torch.uint8).permute(1, 2, 0).cpu().numpy())
        inputs: list[tuple[np.ndarray, np.ndarray | None]] = [(p, None) for p in pictures]
        second = msgspec.structs.replace(params, width=h.width, height=h.height, steps=h.schedule,
                                         edit=Task.IMAGE_TO_IMAGE.value, strength=h.strength, controls=(),
                                         trajectory=None, hires=None, upscale=None)
        done = params.steps

        def step(k: int, total: int) -> bool:
            return on_step(done + k, done + total)

        sink: Any = None
        if on_preview is not None:
            def sink(k: int, total: int, pics: list[tuple[int, torch.Tensor]]) -> None:
                on_preview(done + k, done + total, pics)

        if redraw is not None:  # an IP-Adapter batch's: eager already (``IpAdapters.run``)
            return redraw(second, requests, inputs, step, sink)
        assert isinstance(self.pipeline, EditingPipeline)
        if params.controls:  # eager, as its first pass ran (``controlnet.eager``): its output says "compiled: null"
            base = plain_base(self.pipeline) or self.pipeline  # not the compiled wrapper's edit, which would
            with eager(self.pipeline):  # count the shape as compiled
                return base.edit(second, requests, inputs, step, sink)
        return self.pipeline.edit(second, requests, inputs, step, sink)


    def place(self, asleep: bool) -> None:
        """The upscalers follow their model to host memory while it sleeps, and back."""
        if self.upscalers is not None:
            self.upscalers.place(asleep)


def _held(picture: torch.Tensor, dtype: torch.dtype, output_dtype: str) -> torch.Tensor:
    """An upscaled picture as it waits for the copy: for a uint8 output already its 256 levels, a quarter of
    float32's bytes (half of float16's), rounded from the model's output dtype by the copy's own rounding
    (worker/copier.py's ``to_uint8``), so its bytes are the ones the float picture would have given; for a
    float output, in the model's output dtype."""
    if output_dtype != "uint8":
        return picture.to(dtype)
    return to_uint8(picture.to(dtype))
