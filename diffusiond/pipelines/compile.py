"""``--compile``: torch.compile of a diffusers pipeline's modules, and which batch shapes are new to it.

On small images a GPU spends most of a forward waiting for Python to launch kernels; compiling
the denoiser and the VAE decoder fuses those kernels, and the CUDA-graph modes replay a whole
forward with one launch. What is compiled, and how:

- every denoiser (both of Wan 2.2 A14B's experts, ``transformer_2`` too: pipelines/denoisers.py);
- a transformer denoiser (DiT: Flux, SD3, Wan, LTX) regionally, ``compile_repeated_blocks``:
  its blocks are one code object compiled once, so compiling takes seconds instead of minutes;
- a UNet whole: its blocks differ, and the whole graph is what fuses across them;
- the VAE decoder whole, and the text encoders whole beside a UNet (``compile_rules.left_eager`` says when not).

Shapes are static (``dynamic=False``): each (batch, size, frames, and guidance on/off where guidance
doubles the denoiser's batch) is a graph of its own, exact for that shape and replayable as a CUDA
graph. ``compile_shapes`` bounds how many a module keeps (dynamo's recompile limit); a shape past the
bound runs eager, so a client sending ever new sizes cannot make the worker compile (or hold CUDA
graphs) without end.

A batch smaller than a batch size already compiled for its size runs padded to that size (the
smallest such), with copies of its last request whose outputs are dropped: a forward of 8 costs
far less than compiling a graph for 5 (minutes) or running it eager. Each request keeps its own
generator, so its output is the one it gets in any batch (equal up to float rounding, as
tests/test_pipelines.py measures). Warm up the largest batch (``--warmup 512x512:8``) and every
smaller batch of that size is served by its graph; the engine forms a compiled model's batches in
powers of two (daemon/core/scheduler.py), so ``--warmup 512x512:all`` gives each of them its own.

The compile is lazy: torch compiles a shape when it first runs. The worker runs the ``--warmup``
shapes before it reports ready, and for any other new shape it tells the engine (stage
``compiling``) before the batch starts, using ``will_compile``.

LoRA on a compiled model: its hot-swap slots must be in the modules before they are traced.
Marking a module (``module.compile``) traces nothing, so the worker makes the slots after this
(``pipelines/hotswap.HotSwapAdapters``) and before its warm-up, the first forward.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

import diffusiond.pipelines.ltx2 as ltx2
from diffusiond.ipc.messages import BatchParams, Capabilities, RequestSpec
from diffusiond.pipelines.base import EditArrays, Pipeline, PipelineError, PreviewSink, StepCallback, Task
from diffusiond.pipelines.call_defaults import true_cfg
from diffusiond.pipelines.compile_rules import TEXT_ENCODERS, compile_refusal, left_eager
from diffusiond.pipelines.denoisers import denoisers
from diffusiond.pipelines.fusion import fuse_qkv
from diffusiond.pipelines.spec import compile_shapes
from diffusiond.protocol import COMPILE_MODES

__all__ = ["CompiledPipeline", "cache_report", "compilations", "fuse_qkv", "guidance_is_shape", "set_cache_dir",
           "shape_key"]

_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # inductor's modes that record CUDA graphs


def set_cache_dir(path: str) -> None:
    """Keep inductor's and Triton's compiled artefacts under ``path``: with the state dir's
    ``compile-cache`` a restart loads kernels instead of compiling them again (FX graph cache and
    AOT autograd cache are on by default in torch 2.4+ and live under the inductor cache dir).
    Read by torch when it compiles, so it must be set before the first compile, not before import."""
    if not path:
        return
    Path(path).mkdir(parents=True, exist_ok=True, mode=0o700)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path(path) / "triton"))


def compilations() -> int:
    """Graphs dynamo has compiled in this process (every module and shape counts one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def cache_report() -> str:
    """What this process's compiles took from the compile cache, for the worker's log once its warm-up has run:
    a warm restart that compiled its graphs again (misses) instead of loading them (hits) is seen in the log of a
    GPU run, not guessed from its time. Dynamo's tracing runs at every start, cache or not (issue 31), so its
    seconds are given beside the compiler's (inductor: code generation, or the cache's load of it) and dynamo's
    whole (those two, guards, bytecode); what the warm-up took beyond that whole is its forwards."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    inductor, aot = counters["inductor"], counters["aot_autograd"]

    def seconds(metric: str) -> str:
        return f"{sum(compilation_time_metrics.get(metric, ())):.1f} s"

    def tally(counts: Any, key: str) -> str:
        bypass = counts[f"{key}_bypass"]
        return f"{counts[f'{key}_hit']} hit, {counts[f'{key}_miss']} miss" + (f", {bypass} bypass" if bypass else "")

    return (f"compile cache: FX graphs {tally(inductor, 'fxgraph_cache')}; "
            f"AOT autograd {tally(aot, 'autograd_cache')}; "
            f"dynamo took {seconds('_compile.compile_inner')} for {compilations()} graph(s): "
            f"tracing {seconds('bytecode_tracing')}, the compiler {seconds('OutputGraph.call_user_compiler')}")


def shape_key(params: BatchParams, batch: int, cfg: bool = True, fps: int = 0) -> tuple[int, int, int, int, bool, int]:
    """What makes a compiled graph of the pipeline's modules differ: the tensors' shapes. Steps,
    seeds, prompts and the guidance value are data, not shapes; guidance on or off is a shape where
    it changes the denoiser's inputs (``cfg``: ``guidance_is_shape``); so is the frame rate where the model is
    conditioned on it (``fps``: its default, 0 where not): LTX-2's sound track lasts frames / fps."""
    rate = (params.fps or fps) if fps else 0
    return (batch, params.width, params.height, params.num_frames or 0, cfg and params.guidance > 1.0, rate)


def guidance_is_shape(pipe: Any) -> bool:
    """Whether guidance > 1 gives the denoiser inputs of other shapes: classifier-free guidance doubles its
    batch, and true CFG (QwenImage) runs it on the negative prompt too. A guidance-distilled model (FLUX)
    takes the value as a tensor of unchanged shape, so guidance 1 and 3.5 share every graph (counting
    them apart would report a ``compiling`` stage that compiles nothing and spend a ``compile_shapes`` slot)."""
    cls = type(pipe)
    return hasattr(cls, "do_classifier_free_guidance") or true_cfg(cls)


def _bound_recompiles(max_shapes: int) -> None:
    """Each compiled module keeps at most ``max_shapes`` graphs; past that dynamo runs it eager."""
    import torch._dynamo

    config: Any = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.6
        if hasattr(config, name):
            setattr(config, name, max_shapes)
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 64 * max_shapes)


class CompiledPipeline:
    """A ``Pipeline`` whose diffusers modules are compiled; runs, sleeps and wakes like the eager one."""

    def __init__(self, inner: Pipeline, mode: str, options: Mapping[str, str] | None = None) -> None:
        opts = dict(options or {})
        if mode not in COMPILE_MODES:
            raise PipelineError(f"compile mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
        pipe = getattr(inner, "pipe", None)
        if pipe is None:
            raise PipelineError(f"--compile: model {inner.name} is not a diffusers pipeline; nothing to compile")
        refusal = compile_refusal(opts)
        if refusal:
            raise PipelineError(f"{refusal} (model {inner.name})")
        offload = getattr(inner, "offload", "none")
        if offload != "none":  # hooks move weights between devices inside the forward, which dynamo cannot trace
            raise PipelineError(f"--compile with offload={offload} (model {inner.name}) is refused: offload hooks "
                                "move weights inside the forward and break the compiled graph; drop one of the two")
        self.inner = inner
        self.name, self.task, self.device, self.dtype = inner.name, inner.task, inner.device, inner.dtype
        self.mode = mode
        self.backend = opts.get("compile_backend", "inductor")
        self.max_shapes = compile_shapes(opts)
        self.capabilities: Capabilities = msgspec.structs.replace(inner.capabilities, compiled=mode)
        self._seen: set[tuple[int, int, int, int, bool, int]] = set()
        self._retraces = 0  # forget_shapes
        self._guidance_is_shape = guidance_is_shape(pipe)
        self._fps = ltx2.default_fps(type(pipe)) if ltx2.conditions_on_fps(type(pipe)) else 0  # a warm-up's: None
        self.compiled: list[str] = []  # which modules, for the log and the tests
        self._options = opts
        self._prepare(pipe, opts)
        self.compile(pipe)

    def _prepare(self, pipe: Any, opts: Mapping[str, str]) -> None:
        """Layout changes that can pay with a compiled model; opt-in, since measured on the H200
        (issue 17) channels_last with fused QKV was slower than eager at batch 8 and at 1024²."""
        if opts.get("fuse_qkv") == "1":
            fuse_qkv(pipe)
        if opts.get("channels_last") == "1":
            decoder = getattr(getattr(pipe, "vae", None), "decoder", None)
            for module in (*(m for _, m in denoisers(pipe)), *([decoder] if decoder is not None else [])):
                module.to(memory_format=torch.channels_last)

    def compile(self, pipe: Any) -> None:
        """Mark the modules for compilation; torch compiles each shape when it first runs."""
        _bound_recompiles(self.max_shapes)
        kw: dict[str, Any] = {"backend": self.backend, "dynamic": False}
        if self.backend == "inductor":
            kw["mode"] = self.mode
        regional = False
        for name, denoiser in denoisers(pipe):  # both of Wan 2.2 A14B's experts (pipelines/denoisers.py)
            if name != "unet" and getattr(denoiser, "_repeated_blocks", None):  # a UNet whole (see above)
                denoiser.compile_repeated_blocks(fullgraph=True, **kw)
                self.compiled.append(f"{name} (regional: " + ", ".join(denoiser._repeated_blocks) + ")")
                regional = True
            else:
                denoiser.compile(**kw)
                self.compiled.append(name)
        decoder = getattr(getattr(pipe, "vae", None), "decoder", None)
        if decoder is not None and self.task is Task.TEXT_TO_IMAGE:
            # Video VAEs decode in temporal tiles of changing shape and cache frames between them:
            # compiled, they recompile per tile. Left eager.
            decoder.compile(**kw)
            self.compiled.append("vae.decoder")
        for name in TEXT_ENCODERS:
            encoder = getattr(pipe, name, None)
            if isinstance(encoder, torch.nn.Module) and name not in left_eager(self._options, regional):
                encoder.compile(**kw)
                self.compiled.append(name)

    @property
    def graphs(self) -> bool:
        """Whether shapes that repeat replay as CUDA graphs: inductor's graph modes, on a CUDA device."""
        return self.device.type == "cuda" and self.backend == "inductor" and self.mode in _GRAPH_MODES

    @property
    def last_trajectories(self) -> Any:
        """The last run's side arrays (trajectories, sound tracks: ``DiffusersPipeline.last_trajectories``), which
        the worker takes from whatever pipeline it holds: a compiled LTX-2 brings its sound track back too."""
        return getattr(self.inner, "last_trajectories", None)

    @property
    def warmup_runs(self) -> int:
        """How often the worker's warm-up runs each shape: twice where CUDA-graph trees record a shape's
        graph on its second run, else once, since the first run compiles all there is (issue 31)."""
        return 2 if self.graphs else 1

    def _key(self, params: BatchParams, batch: int) -> tuple[int, int, int, int, bool, int]:
        return shape_key(params, batch, self._guidance_is_shape, self._fps)

    def run_size(self, params: BatchParams, batch: int) -> int:
        """The batch size a batch of ``batch`` runs at: its own when compiled or when no larger
        size of its shape is, else the smallest larger compiled one (padded)."""
        key = self._key(params, batch)
        if key in self._seen or params.edit is not None:  # edits run unpadded (their inputs are per request)
            return batch
        larger = [k[0] for k in self._seen if k[1:] == key[1:] and k[0] > batch]
        return min(larger, default=batch)

    def will_compile(self, params: BatchParams, batch: int) -> bool:
        """Whether running this batch compiles (a new shape, within the bound): its first pass, or its hires
        pass (an edit at the hires size, unpadded, as ``Finisher`` runs it). A ControlNet or IP-Adapter batch
        runs eager, its hires pass too (``controlnet.eager``), so never."""
        if params.controls or params.ip_adapters:
            return False
        keys = {self._key(params, self.run_size(params, batch))}
        if params.hires is not None:
            h = params.hires
            keys.add(self._key(msgspec.structs.replace(params, width=h.width, height=h.height), batch))
        return not keys <= self._seen and len(self._seen) < self.max_shapes

    def run(self, params: BatchParams, requests: Sequence[RequestSpec], on_step: StepCallback,
            on_preview: PreviewSink | None = None) -> list[torch.Tensor]:
        n = len(requests)
        size = self.run_size(params, n)
        if size > n:  # padding: nobody's output, so no previews of it either
            last = requests[-1]
            requests = [*requests, *(msgspec.structs.replace(last, request_id=f"{last.request_id}+pad{i}",
                                                             preview_every=0) for i in range(size - n))]
        if self.graphs:
            # CUDA-graph trees: a new iteration starts here, so outputs of the last run may be reused.
            torch.compiler.cudagraph_mark_step_begin()
        outputs = self.inner.run(params, requests, on_step, on_preview)[:n]
        if len(self._seen) < self.max_shapes:
            self._seen.add(self._key(params, size))
        # No copy of the outputs is needed for the CUDA-graph modes: the decoder's output (which
        # lives in the graph's memory pool) is denormalised into a fresh tensor by the pipeline.
        return outputs

    def edit(self, params: BatchParams, requests: Sequence[RequestSpec], inputs: Sequence[EditArrays],
             on_step: StepCallback, on_preview: PreviewSink | None = None, **more: Any) -> list[torch.Tensor]:
        """Edits run on the diffusers pipeline ``from_pipe`` builds from the same modules, so they
        run compiled too; a model that cannot edit says so. ``more``: as the inner pipeline's (``pictures``)."""
        edit = getattr(self.inner, "edit", None)
        if edit is None:
            raise PipelineError(f"model {self.name} cannot edit images")
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        outputs: list[torch.Tensor] = edit(params, requests, inputs, on_step, on_preview, **more)
        if len(self._seen) < self.max_shapes:
            self._seen.add(self._key(params, len(requests)))
        return outputs

    def forget_shapes(self) -> None:
        """The compiled modules changed structure (a LoRA slot lost, ``hotswap.HotSwapAdapters._lose``): each shape
        traces again on its next batch, which must then show ``compiling``, and dynamo needs room
        for those graphs beside the old ones, which stay in its cache unusable."""
        self._seen.clear()
        self._retraces += 1
        _bound_recompiles(self.max_shapes * (1 + self._retraces))

    def sleep(self) -> None:
        self.inner.sleep()

    def wake(self) -> None:
        self.inner.wake()
