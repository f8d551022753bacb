"""Qwen-Image-Edit Plus (2509, 2511: QwenImageEditPlusPipeline): one edit from several input pictures (issue 30).

The pipeline takes ``image`` as a list of pictures for one prompt, which the prompt names "Picture 1", "Picture 2",
... in order; it resizes each itself (about 384² for the Qwen2.5-VL encoder, about 1024² for the VAE, each at its own
aspect ratio) and sizes its output from the LAST one when no height and width are given. The engine sends the
output size always (the last picture's own, rounded down to the model's step, unless the request names one), so
the size a job reports is the size made. The pipeline refuses a batch of more than one prompt
("currently only supports batch_size=1"), so a batch runs as one call per request here, each with its own generator,
which gives a request the output it would have alone.

How many pictures one request may send: the pipeline takes any number, but each adds its ~1024² latents to the
transformer's sequence (a third picture doubles the sequence of a one-picture edit) and the release's card says
"Optimal performance is currently achieved with 1 to 3 input images" (huggingface.co/Qwen/Qwen-Image-Edit-2509):
we cap at 3.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from diffusiond.ipc.messages import RequestSpec
from diffusiond.pipelines.base import EditArrays, PipelineError, PreviewSink, StepCallback

MAX_INPUT_IMAGES = 3
_CLASS = "QwenImageEditPlus"


def max_input_images(pipes: Iterable[Any]) -> int:
    """What ``Capabilities.max_input_images`` says for a model whose edit pipelines are ``pipes``: 1 unless one
    of them takes several pictures."""
    return MAX_INPUT_IMAGES if any(takes_several(p) for p in pipes) else 1


def takes_several(pipe: Any) -> bool:
    return type(pipe).__name__.startswith(_CLASS)


Call = Callable[[Sequence[RequestSpec], list[Any], PreviewSink | None, StepCallback], list[torch.Tensor]]
"""One pipeline call for ``requests`` with these pictures as ``image``, previews to the sink, steps to the callback."""


def one_by_one(call: Call, owner: Any, requests: Sequence[RequestSpec], inputs: Sequence[EditArrays],
               pictures: Sequence[Sequence[np.ndarray]], on_preview: PreviewSink | None,
               on_step: StepCallback) -> list[torch.Tensor]:
    """Each request's edit in a call of its own: its earlier pictures (``pictures[k]``, at their own sizes) and
    then its image, as PIL pictures. ``owner`` (the DiffusersPipeline) keeps each call's side arrays in
    ``last_trajectories``; they are gathered here, one entry a request, as a batch's would be. The batch's
    progress counts every call's steps in turn (step N of N, then 1 of N again, read as going backwards)."""
    from PIL import Image

    if len(pictures) not in (0, len(requests)):
        raise PipelineError(f"an edit batch of {len(requests)} requests came with {len(pictures)} picture lists")
    outputs: list[torch.Tensor] = []
    sides: list[dict[str, Any]] = []
    for k, (request, (image, _)) in enumerate(zip(requests, inputs, strict=True)):
        earlier = pictures[k] if pictures else ()
        if len(earlier) + 1 > MAX_INPUT_IMAGES:
            raise PipelineError(f"request {request.request_id} sent {len(earlier) + 1} input images; "
                                f"{_CLASS} models take at most {MAX_INPUT_IMAGES}")
        shown = [Image.fromarray(p) for p in (*earlier, image)]
        sink = None if on_preview is None else _shifted(on_preview, k)
        outputs.extend(call([request], shown, sink, _counted(on_step, k, len(requests))))
        sides.extend(getattr(owner, "last_trajectories", None) or [])
    if sides:
        owner.last_trajectories = sides
    return outputs


def _counted(on_step: StepCallback, k: int, calls: int) -> StepCallback:
    """Call ``k`` of ``calls``'s steps as steps of the whole batch."""
    return lambda step, total: on_step(k * total + step, calls * total)


def _shifted(on_preview: PreviewSink, k: int) -> PreviewSink:
    """A sink for a one-request call that files its previews under request ``k`` of the batch."""
    def sink(step: int, total: int, shown: list[tuple[int, torch.Tensor]]) -> None:
        on_preview(step, total, [(k, picture) for _, picture in shown])
    return sink
