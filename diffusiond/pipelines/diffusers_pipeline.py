"""``DiffusersPipeline``: the ``Pipeline`` protocol over any diffusers text-to-image or text-to-video pipeline.

The worker speaks one small protocol; diffusers has hundreds of pipeline classes with slightly
different ``__call__`` signatures. This adapter is the single place that bridges them: one call
per batch with a generator per request (so batching never changes a request's output), outputs
left on the device as float [0, 1] (so the worker's async output path does the copy), a per-step
callback that can stop the run (so cancellation is prompt), and schedulers picked by short name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

import diffusiond.pipelines.ltx2 as ltx2
import diffusiond.pipelines.qwen_edit_plus as qwen_edit_plus
import diffusiond.pipelines.vae_tiles as vae_tiles
from diffusiond import protocol
from diffusiond.ipc.messages import BatchParams, Capabilities, RequestSpec
from diffusiond.pipelines.attention import apply_attention
from diffusiond.pipelines.base import (
    EditArrays,
    Interrupted,
    PipelineError,
    PreviewSink,
    RequestDefaults,
    StepCallback,
    Task,
    generators,
    native_side,
    with_defaults,
)
from diffusiond.pipelines.call_defaults import call_defaults, negative_prompt_acts, true_cfg
from diffusiond.pipelines.edit_pipes import edit_kwargs, edit_pipes, share_image_encoder
from diffusiond.pipelines.frame_rules import check_frames, frame_step, min_side, size_step
from diffusiond.pipelines.hostcopy import HostCopy
from diffusiond.pipelines.offload import apply_offload, device_bytes
from diffusiond.pipelines.phases import Phases
from diffusiond.pipelines.pipeline_classes import FRAME_ARGS, call_args, task_for_class
from diffusiond.pipelines.previews import Previewer, make_previewer
from diffusiond.pipelines.quant import apply_quant, parse_quant
from diffusiond.pipelines.spec import offload_mode, resident_blocks
from diffusiond.pipelines.speedups import apply_fp8_rows, apply_speedups, step_cache_context
from diffusiond.pipelines.streaming import BlockStreamer
from diffusiond.pipelines.trajectories import LatentRecorder
from diffusiond.protocol import EDIT_TASKS, FLOW_SCHEDULERS, VIDEO_TASKS, schedulers_for

log = logging.getLogger(__name__)

__all__ = ["FLOW_SCHEDULERS", "SCHEDULERS", "DiffusersPipeline", "check_frames", "task_for_class"]

_SCHEDULER_CLASSES = {
    "euler": "EulerDiscreteScheduler",
    "euler-a": "EulerAncestralDiscreteScheduler",
    "dpm++": "DPMSolverMultistepScheduler",
    "ddim": "RolloutDDIMScheduler",  # diffusers' DDIM at eta 0; DDPO's step with log-probs above
    "unipc": "UniPCMultistepScheduler",
    "flow-match": "FlowMatchEulerDiscreteScheduler",
    "flow-sde": "FlowSDEScheduler",  # Flow-GRPO's stochastic step with log-probs
}
# The scheduler names requests may use (protocol.SCHEDULERS) -> class names, diffusers' or (the two
# that record log-probs, issue 29) rollout_schedulers' subclasses of them; keyed by the
# protocol's list so a name added there without a class here fails at import, not in a request.
SCHEDULERS: dict[str, str] = {name: _SCHEDULER_CLASSES[name] for name in protocol.SCHEDULERS}

def _is_flow_scheduler(scheduler: Any) -> bool:
    """Flow-matching models need flow schedulers; their config says so in one of a few ways."""
    config = getattr(scheduler, "config", {}) or {}
    return (
        "FlowMatch" in type(scheduler).__name__
        or bool(config.get("use_flow_sigmas"))
        or config.get("prediction_type") == "flow_prediction"
    )


class _Stop(Exception):
    """Raised inside diffusers' step callback to leave the denoising loop at once."""

    def __init__(self, step: int, total: int) -> None:
        super().__init__(step, total)
        self.step = step
        self.total = total


class DiffusersPipeline:
    """Drives one loaded diffusers pipeline; runs are serial (schedulers hold per-run state).

    ``defaults`` override the request defaults inferred from the model (a published model's own
    steps and size); ``synthetic_weights`` marks models built in code with random weights
    (``random:<preset>``), whose outputs are noise; ``approximations`` name what the weights themselves
    approximate (a GGUF file's quantization). They only reach ``capabilities``.
    """

    def __init__(
        self,
        pipe: Any,
        *,
        name: str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        options: Mapping[str, str] | None = None,
        defaults: RequestDefaults | None = None,
        synthetic_weights: bool = False,
        approximations: tuple[str, ...] = (),
        phases: Phases | None = None,
    ) -> None:
        # the load's spans, for the worker's start line (pipelines/phases.py); a loader that read the
        # files hands its own in with that span already marked
        self.load_phases = phases if phases is not None else Phases()
        options = dict(options or {})
        self.name = name
        self.task = task_for_class(type(pipe))
        self.device = torch.device(device)
        self.dtype = dtype
        self._pipe = pipe
        self._args = call_args(type(pipe))
        self._frames_arg = next((a for a in FRAME_ARGS if a in self._args), None)
        self._default_scheduler = pipe.scheduler
        self._flow = _is_flow_scheduler(pipe.scheduler)
        self._schedulers: dict[str, Any] = {}
        # Issue 29's rollouts: the last run's per-step log-probs, timesteps and sigmas (rollout_schedulers.
        # Trajectory; None after a deterministic run); ``record_latents`` (tests) keeps each step's latents and
        # model output on the host too. ``last_trajectories``: each request's side arrays (trajectories.py), with
        # its sound track (ltx2.py) when it asked for one.
        self.last_rollout: Any = None
        self.record_latents = False
        self.last_trajectories: list[dict[str, torch.Tensor]] | None = None
        mode = offload_mode(options)
        if mode == "auto":  # the daemon resolves auto from the files and its budget; loaded alone, keep it all
            log.info("%s: offload=auto without a budget to choose by: everything stays on the device", name)
            mode = "none"
        self.offload = mode
        self._offload = mode != "none"
        self._asleep = False
        self._hostcopy: HostCopy | None = None
        video = self.task in VIDEO_TASKS
        multiple = size_step(pipe)
        smallest = min_side(pipe, multiple)
        side = max(smallest, native_side(pipe) // multiple * multiple)  # the default size must be one it makes
        inferred = Capabilities(
            task=self.task.value,
            width=side,
            height=side,
            steps=30 if video else 25,  # where the class declares none (call_defaults.py)
            guidance=5.0 if video else 7.5,
            num_frames=9,
            fps=ltx2.default_fps(type(pipe)),
            num_frames_step=frame_step(pipe) if video else 1,  # valid num_frames: 1 + k * step
            size_step=multiple,
            min_size=smallest,
            min_steps=2 if getattr(getattr(pipe, "scheduler", None), "config", {}).get("shift_terminal") else 1,
            flow_scheduler=self._flow,
            synthetic_weights=synthetic_weights,
            negative_prompt=negative_prompt_acts(type(pipe)),
        )
        self._edit_pipes: dict[Task, Any] = edit_pipes(pipe, self.task)
        inferred = msgspec.structs.replace(inferred, edits=tuple(t.value for t in self._edit_pipes),
                                           max_input_images=qwen_edit_plus.max_input_images(self._edit_pipes.values()))
        self.capabilities = with_defaults(with_defaults(inferred, call_defaults(type(pipe))), defaults)
        self.load_phases.mark("sibling pipelines")

        if getattr(pipe, "safety_checker", None) is not None:
            # The checker blacks out outputs and costs a CLIP pass per image; callers filter themselves.
            pipe.safety_checker = None
        for p in (pipe, *self._edit_pipes.values()):
            p.set_progress_bar_config(disable=True)
        for option, method in (("vae_tiling", "enable_tiling"), ("vae_slicing", "enable_slicing")):
            if options.get(option) == "1":
                vae = getattr(pipe, "vae", None)
                if vae is None or not hasattr(vae, method):
                    raise PipelineError(f"{option}=1: {type(pipe).__name__} has no VAE that supports it")
                getattr(vae, method)()
        quantized = apply_quant(pipe, parse_quant(options["quant"]), self.device, dtype) if options.get("quant") else ()
        quantized = (*quantized, *apply_fp8_rows(pipe, options, self.device, resident=not self._offload))
        self._streamer: BlockStreamer | None = None  # offload=stream's: its resident part sleeps and wakes
        if self._offload:
            self._streamer = apply_offload(pipe, mode, self.device, resident_blocks(options))
        else:
            pipe.to(self.device)
        self.load_phases.mark(f"offload={mode}" if self._offload else f"to {self.device.type}")
        self._previewer: Previewer | None = make_previewer(pipe, options.get("preview_decoder", ""), self.device, dtype)
        self.capabilities = msgspec.structs.replace(self.capabilities, previews=self._previewer is not None)
        # a GGUF's quantization first, then quant='s, then the speed-ups', then the attention kernel's
        attention = apply_attention(pipe, options.get("attention", ""), self.device)
        approximations = (*approximations, *quantized, *apply_speedups(pipe, options, self.device),
                          *attention.approximations)
        self.capabilities = msgspec.structs.replace(self.capabilities, approximations=approximations, offload=mode,
                                                    attention=attention.name, sample_rate=ltx2.sample_rate(pipe),
                                                    fps_conditions=ltx2.conditions_on_fps(type(pipe)))
        self.load_phases.mark("previews, speed-ups, attention")

    def device_weight_bytes(self) -> int | None:
        """What residency counts this model at when it is offloaded (``base.weight_bytes``): only what the
        offload keeps on the device (pipelines/offload.py); None when it is all resident (count the modules)."""
        return device_bytes(self._pipe, self.offload) if self._offload else None

    @property
    def pipe(self) -> Any:
        """The wrapped diffusers pipeline (tests and diagnostics only)."""
        return self._pipe

    def _scheduler(self, short: str | None) -> Any:
        """One scheduler object per name, built from the model's own config so its betas/shift match."""
        if short is None:
            return self._default_scheduler
        if short not in SCHEDULERS:
            raise PipelineError(f"unknown scheduler {short!r}; known: {', '.join(SCHEDULERS)}")
        if (short in FLOW_SCHEDULERS) != self._flow:
            allowed = sorted(schedulers_for(self._flow))
            kind = "flow-matching" if self._flow else "noise-prediction"
            raise PipelineError(
                f"scheduler {short!r} does not fit {self.name} (a {kind} model); use one of {', '.join(allowed)}"
            )
        cached = self._schedulers.get(short)
        if cached is None:
            import diffusers

            import diffusiond.pipelines.rollout_schedulers as rollout_schedulers

            cls = getattr(rollout_schedulers, SCHEDULERS[short], None) or getattr(diffusers, SCHEDULERS[short])
            cached = cls.from_config(self._default_scheduler.config)
            self._schedulers[short] = cached
        return cached

    def run(self, params: BatchParams, requests: Sequence[RequestSpec], on_step: StepCallback,
            on_preview: PreviewSink | None = None) -> list[torch.Tensor]:
        """One diffusers call for the whole batch: one forward per step serves every request."""
        if not requests:
            return []
        if self.task in EDIT_TASKS:
            raise PipelineError(f"model {self.name} does {self.task.value} only; it needs an input image")
        return self._call(self._pipe, self._args, params, requests, on_step, {}, on_preview)

    def edit(self, params: BatchParams, requests: Sequence[RequestSpec], inputs: Sequence[EditArrays],
             on_step: StepCallback, on_preview: PreviewSink | None = None,
             more: Mapping[str, Any] | None = None, *, pipe: Any = None,
             drawn: Callable[[list[torch.Generator]], dict[str, Any]] | None = None,
             pictures: Sequence[Sequence[np.ndarray]] = ()) -> list[torch.Tensor]:
        """A batch of edits on the pipeline built for it with ``from_pipe`` (the same weights); ``more``
        are further call arguments (an IP-Adapter's reference image, control pictures). ``pipe`` runs
        in place of the model's own edit sibling (the ControlNet one, which takes the same image, mask
        and strength), ``drawn`` as ``_call``'s. ``pictures``: each request's input pictures before its image,
        for a model that takes several (qwen_edit_plus.py)."""
        if not requests:
            return []
        task = Task(params.edit) if params.edit in set(Task) else None
        if task is None or task not in self._edit_pipes:
            raise PipelineError(f"model {self.name} cannot do {params.edit}")
        pipe = self._edit_pipes[task] if pipe is None else pipe
        images = torch.from_numpy(np.stack([img for img, _ in inputs])).permute(0, 3, 1, 2).float() / 255
        args = call_args(type(pipe))
        strength = 1.0 if params.strength is None else params.strength
        extra = {**edit_kwargs(task, images, strength, args, params.width * params.height,
                                 type(pipe).__name__), **(more or {})}
        if qwen_edit_plus.takes_several(pipe):  # one call a request, with its pictures
            return qwen_edit_plus.one_by_one(lambda reqs, shown, sink, step: self._call(
                pipe, args, params, reqs, step, {**extra, "image": shown}, sink, drawn), self, requests, inputs,
                pictures, on_preview, on_step)
        if task is not Task.INPAINTING:
            return self._call(pipe, args, params, requests, on_step, extra, on_preview, drawn)
        planes = [m for _, m in inputs]
        if any(m is None for m in planes):
            raise PipelineError("an inpainting request came without its mask")
        masks = torch.from_numpy(np.stack(planes)).permute(0, 3, 1, 2).float() / 255  # type: ignore[arg-type]
        extra["mask_image"] = masks
        outputs = self._call(pipe, args, params, requests, on_step, extra, on_preview, drawn)
        # Outside the mask the answer is the input itself, as A1111 and diffusers' ``apply_overlay``
        # make it: the VAE round trip (and a dedicated inpainting UNet) would otherwise shift those
        # pixels a little, and the user asked for them to stay.
        device, dtype = outputs[0].device, outputs[0].dtype
        images, masks = images.to(device, dtype), masks.to(device, dtype)
        return [out * m + img * (1 - m) for out, img, m in zip(outputs, images, masks, strict=True)]

    def _call(self, pipe: Any, args: frozenset[str], params: BatchParams, requests: Sequence[RequestSpec],
              on_step: StepCallback, extra: dict[str, Any], on_preview: PreviewSink | None,
              drawn: Callable[[list[torch.Generator]], dict[str, Any]] | None = None) -> list[torch.Tensor]:
        """``drawn``, where given, takes the requests' generators before the call and returns arguments
        for it: a sibling pipeline that would draw from them in another order than the model's own
        (FLUX's ControlNet samples its picture's latents first) draws the noise the way the model does."""
        if self._asleep:
            raise PipelineError(f"model {self.name} is asleep; wake it before running")
        if params.steps < self.capabilities.min_steps:
            raise PipelineError(protocol.too_few_steps("steps", params.steps, self.name, self.capabilities.min_steps))
        pipe.scheduler = self._scheduler(params.scheduler)
        if pipe is not self._pipe:
            share_image_encoder(self._pipe, pipe)
        gens = generators(requests)
        rollout = pipe.scheduler if hasattr(pipe.scheduler, "trajectory") else None
        if rollout is not None:  # its noise comes from the requests' own generators, after the initial latents
            rollout.begin(gens, params.noise_level if params.scheduler == "flow-sde" else params.eta,
                          record_latents=self.record_latents)
        self.last_rollout = self.last_trajectories = None
        if params.trajectory is not None and rollout is None:
            raise PipelineError(f"a trajectory needs scheduler flow-sde, or ddim with eta > 0 (got {params.scheduler})")
        recorder = LatentRecorder(params.trajectory, rollout) if params.trajectory is not None else None
        kwargs: dict[str, Any] = {
            "prompt": [r.prompt for r in requests],
            "num_inference_steps": params.steps,
            "generator": gens,
            "output_type": "pt",
            "return_dict": False,
            **extra,
        }
        if drawn is not None:
            kwargs.update(drawn(gens))
        if "height" in args:  # image-to-image pipelines take the size from the image
            kwargs["height"], kwargs["width"] = params.height, params.width
        if "guidance_scale" in args:
            kwargs["guidance_scale"] = params.guidance
        if true_cfg(type(pipe)):
            kwargs["true_cfg_scale"] = params.guidance
        if "negative_prompt" in args:
            kwargs["negative_prompt"] = [r.negative_prompt or "" for r in requests]
        if params.num_frames is not None:
            if self._frames_arg is None:
                raise PipelineError(f"model {self.name} makes images; num_frames does not apply")
            check_frames(self.name, self.capabilities.num_frames_step, params.num_frames)
            kwargs[self._frames_arg] = params.num_frames
        kwargs.update(ltx2.frame_rate_args(type(pipe), params.fps))

        previewer = self._previewer if on_preview is not None else None
        wants = [(k, r.preview_every, r.preview_max_side) for k, r in enumerate(requests) if r.preview_every > 0]

        def step_end(p: Any, i: int, _t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            total = int(getattr(p, "_num_timesteps", 0) or params.steps)
            due = [(k, side) for k, every, side in wants if (i + 1) % every == 0 and i + 1 < total]
            if previewer is not None and due and isinstance(tensors.get("latents"), torch.Tensor):
                assert on_preview is not None
                pictures = previewer(tensors["latents"], [k for k, _ in due], params, [s for _, s in due])
                on_preview(i + 1, total, [(k, pic) for (k, _), pic in zip(due, pictures, strict=True)])
            if recorder is not None and isinstance(tensors.get("latents"), torch.Tensor):
                recorder.step_end(i, total, tensors["latents"])
            if not on_step(i + 1, total):
                # Raising (rather than setting ``_interrupt``) also skips the VAE decode: diffusers
                # pipelines that honour ``_interrupt`` still decode the half-denoised latents.
                raise _Stop(i + 1, total)
            return tensors

        kwargs["callback_on_step_end"] = step_end
        try:  # a batch that wants no sound skips its decode (ltx2.py); VAE tiles fit the size (vae_tiles.py)
            with ltx2.without_sound(pipe, [r.audio for r in requests]), vae_tiles.fitted(pipe, params.height,
                                                                                         params.width), \
                    step_cache_context(pipe):
                out = pipe(**kwargs)
        except BaseException as exc:  # its own cleanup was skipped: the step cache's state (else the next batch,
            pipe.maybe_free_model_hooks()  # or an OOM retry, starts from it) and offload=model's hooks are reset
            if isinstance(exc, _Stop):
                raise Interrupted(exc.step, exc.total) from None
            if isinstance(exc, ValueError):  # diffusers' check_inputs: size not divisible by the VAE factor...
                raise PipelineError(f"{self.name} refused the request: {exc}") from exc
            raise
        self.last_rollout = rollout.trajectory() if rollout is not None else None
        self.last_trajectories = recorder.arrays(pipe, params, len(requests)) if recorder is not None else None
        sound = ltx2.waveforms(out, [r.audio for r in requests])  # the side arrays' other member (issue 30)
        if sound is not None:
            self.last_trajectories = [{**t, **a} for t, a in zip(self.last_trajectories or [{}] * len(sound), sound,
                                                                 strict=True)]
        return self._split(out[0] if isinstance(out, tuple) else out, len(requests), params)

    def _split(self, batch: Any, n: int, params: BatchParams) -> list[torch.Tensor]:
        """Per-request views of the batch output: (C,H,W) images or (F,C,H,W) videos.

        Sizes and frame counts are checked against the request: some pipelines round a size or a
        frame count they cannot make (with a log warning at most), and a client must never get a
        smaller output than it asked for without an error saying why.
        """
        want = 4 if self.task in VIDEO_TASKS or params.edit == Task.IMAGE_TO_VIDEO else 3
        items = list(batch) if isinstance(batch, list | tuple) else list(batch.unbind(0))
        if len(items) != n:
            raise PipelineError(f"{self.name} returned {len(items)} outputs for {n} requests")
        result: list[torch.Tensor] = []
        for item in items:
            if not isinstance(item, torch.Tensor) or item.dim() != want:
                shape = tuple(item.shape) if isinstance(item, torch.Tensor) else type(item).__name__
                raise PipelineError(f"{self.name} returned an output of shape {shape}; expected {want} dims")
            size = (int(item.shape[-2]), int(item.shape[-1]))
            if size != (params.height, params.width):
                raise PipelineError(
                    f"{self.name} made {size[1]}x{size[0]} outputs for a {params.width}x{params.height} request; "
                    "the model rounds sizes it cannot make: ask for a size it supports"
                )
            if want == 4 and params.num_frames is not None and item.shape[0] != params.num_frames:
                raise PipelineError(f"{self.name} made {item.shape[0]} frames for num_frames={params.num_frames}")
            result.append(item)
        return result

    def sleep(self) -> None:
        """Free the accelerator for someone else; weights wait in host memory."""
        if self._asleep:
            return
        self._asleep = True
        if self.device.type == "cpu":
            return
        if not self._offload:  # offloaded models already live on the host between calls
            self._host().leave()
        elif self._streamer is not None:  # but for stream's resident blocks and its ring
            self._streamer.leave()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Bring weights back so the next run pays no transfer."""
        if not self._asleep:
            return
        self._asleep = False
        if self.device.type != "cpu" and not self._offload:
            self._host().come_back()
        elif self.device.type != "cpu" and self._streamer is not None:
            self._streamer.come_back()

    def _host(self) -> HostCopy:
        """The weights' pinned host side (hostcopy.py), made on the first move and kept."""
        if self._hostcopy is None:
            modules = [c for c in self._pipe.components.values() if isinstance(c, torch.nn.Module)]
            self._hostcopy = HostCopy(modules, self.device)
        return self._hostcopy
