"""LoRA adapters on a compiled model (``--compile``): hot-swapped into fixed slots, never recompiled.

CPU tests compile with torch's "eager" backend (as tests/test_compile.py): dynamo traces the
graphs and guards them exactly as with inductor, so a switch that changed the graph would show as
a compilation, and the kernels are the eager ones. The base model's outputs then equal the uncompiled
model's bit for bit; an adapter in a slot differs by float rounding only (a rank padded to the slot's
and a weight kept as a tensor so that it can change without a new graph: about 4e-5 on pixels in
[0, 1], where an adapter moves them by up to 1), so adapters are compared to 1e-3 (inductor's
tolerance is test_gpu's). Compilations are dynamo's own counter, read in the process that compiles.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from daemonkit import Daemon, http, submit, wait_job
from lorakit import build_lora

from diffusiond.ipc import messages as m
from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.compile import CompiledPipeline, compilations
from diffusiond.pipelines.hotswap import HotSwapAdapters, adapters_for
from diffusiond.pipelines.loras import Adapters, unsupported

EAGER_BACKEND = {"compile_backend": "eager"}
TINY = m.BatchParams(width=64, height=64, steps=2, guidance=5.0)
A = (m.LoraRef("a", 1.0),)
B = (m.LoraRef("b", 0.7),)
AB = (m.LoraRef("a", 0.5), m.LoraRef("b", 1.0))
ADAPTER_ATOL = 1e-3  # float rounding of a padded slot (see above), far below what an adapter changes


@pytest.fixture(scope="module")
def unet_loras(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> dict[str, Path]:
    """UNet-only adapters of different ranks (4 and 2: the slots are padded to the largest)."""
    root = tmp_path_factory.mktemp("hotswap-loras")
    return {"a": build_lora(root / "a", seed=11, rank=4, text_encoder=False),
            "b": build_lora(root / "b", seed=12, rank=2, text_encoder=False),
            "big": build_lora(root / "big", seed=13, rank=8, text_encoder=False),
            "te": build_lora(root / "te", seed=14, rank=4, text_encoder=True)}


def run(pipe: object, seeds: tuple[int, ...] = (1,)) -> torch.Tensor:
    reqs = [m.RequestSpec(request_id=str(s), prompt="a red fox", seed=s) for s in seeds]
    with torch.inference_mode():
        return torch.stack(pipe.run(TINY, reqs, lambda _s, _t: True))  # type: ignore[attr-defined]


def compiled_tiny() -> CompiledPipeline:
    return CompiledPipeline(load_pipeline("tiny", device="cpu", dtype="float32"), "default", EAGER_BACKEND)


def test_switching_adapters_on_a_compiled_model_never_recompiles_and_matches_the_eager_model(
        unet_loras: dict[str, Path]) -> None:
    eager = load_pipeline("tiny", device="cpu", dtype="float32")
    reference = adapters_for(eager, {}, 2)
    assert type(reference) is Adapters
    assert reference.register("a", str(unet_loras["a"])) == reference.register("b", str(unet_loras["b"])) == ""
    want: dict[tuple[m.LoraRef, ...], torch.Tensor] = {}
    for loras in ((), A, B, AB):
        reference.activate(loras)
        want[loras] = run(eager)

    base_without_hotswap = run(compiled_tiny())
    pipe = compiled_tiny()
    adapters = adapters_for(pipe, {}, 2, target_rank=4)
    assert isinstance(adapters, HotSwapAdapters)
    assert adapters.register("a", str(unet_loras["a"])) == adapters.register("b", str(unet_loras["b"])) == ""
    base = run(pipe)  # warm-up: the one compilation of this shape, LoRA slots included
    warm = compilations()
    assert torch.equal(base, base_without_hotswap)  # zeroed slots add exactly nothing
    assert torch.equal(base, want[()])
    for loras in (A, B, (), A, AB, B, ()):
        adapters.activate(loras)
        got = run(pipe)
        assert torch.allclose(got, want[loras], atol=ADAPTER_ATOL, rtol=0), loras
        assert loras == () or not torch.allclose(got, base, atol=ADAPTER_ATOL, rtol=0)
    assert compilations() == warm  # A, B, none, A again, both: weights swapped in place, no new graph


def test_what_cannot_be_hot_swapped_is_refused_at_registration_saying_why(unet_loras: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(unet_loras["a"] / "pytorch_lora_weights.safetensors"))
    key = next(k for k in sorted(weights) if ".lora_A." in k)
    weights[key] = torch.zeros(weights[key].shape[0], weights[key].shape[1] + 8)  # in-features tiny lacks
    (tmp_path / "misfit").mkdir()
    save_file(weights, str(tmp_path / "misfit" / "pytorch_lora_weights.safetensors"))
    pipe = compiled_tiny()
    adapters = adapters_for(pipe, {}, 2, target_rank=4)
    assert adapters is not None
    why = adapters.register("big", str(unet_loras["big"]))
    assert "rank 8 is above 4" in why and "register it at start (--lora)" in why
    why = adapters.register("te", str(unet_loras["te"]))
    assert "text-encoder weights" in why and "without --compile" in why
    assert "size mismatch" in adapters.register("misfit", str(tmp_path / "misfit"))  # fails making the slots
    assert adapters.register("a", str(unet_loras["a"])) == ""  # ... and left none behind: "a" makes them
    assert set(adapters.paths) == {"a"}  # the refused ones left nothing behind
    with pytest.raises(Exception, match="not registered"):
        adapters.activate((m.LoraRef("big", 1.0),))
    # no adapter at start: no slots, and the reason names what to do
    assert adapters_for(compiled_tiny(), {}, 2, target_rank=0) is None
    assert "--lora NAME=PATH" in unsupported(compiled_tiny())


def test_an_adapter_whose_settings_differ_from_the_slots_is_refused_and_costs_no_slot(
        unet_loras: dict[str, Path], tmp_path: Path) -> None:
    """Per-layer alphas (a kohya file's) differ from the slots' settings; diffusers finds that only
    inside the try that deletes the slot, so each try cost a slot, and the third a serving adapter's."""
    from lorakit import to_kohya
    from safetensors.torch import load_file, save_file

    weights = load_file(str(to_kohya(unet_loras["b"], tmp_path / "b.safetensors")))
    alphas = sorted(k for k in weights if k.endswith(".alpha"))
    for key in alphas[: len(alphas) // 2 + 1]:
        weights[key] = torch.tensor(1.0)  # half the layers at alpha 1, the rest at the file's
    save_file(weights, str(tmp_path / "mixed.safetensors"))
    adapters = adapters_for(compiled_tiny(), {}, 3, target_rank=4)
    assert isinstance(adapters, HotSwapAdapters) and adapters.register("a", str(unet_loras["a"])) == ""
    for _ in range(4):
        why = adapters.register("mixed", str(tmp_path / "mixed.safetensors"))
        assert "its settings differ from the slots'" in why and "alpha_pattern" in why, why
    assert len(adapters.slots) == 3 and not adapters.lost and "mixed" not in adapters.paths
    adapters.activate(A)  # "a" keeps its slot


def test_a_kohya_sdxl_file_with_sgm_block_names_swaps_into_a_slot(tmp_path: Path) -> None:
    """Kohya's SDXL files name the UNet's blocks as SGM does (``input_blocks_4_1``); the check read
    them without the UNet's config, so diffusers did not map them, and a file that swaps in fine was refused."""
    import re

    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    config = dict(sample_size=16, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 64),
                  down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), norm_num_groups=8,
                  up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=64,
                  attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
                  addition_time_embed_dim=8, transformer_layers_per_block=(1, 2),
                  projection_class_embeddings_input_dim=80)
    unet = UNet2DConditionModel(**config)
    pipe = StableDiffusionXLPipeline(vae=None, text_encoder=None, text_encoder_2=None, tokenizer=None,
                                     tokenizer_2=None, unet=unet, scheduler=None)

    def lora(seed: int) -> dict[str, torch.Tensor]:
        u = UNet2DConditionModel(**config)
        torch.manual_seed(seed)
        u.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                 init_lora_weights=False))
        return {"unet." + k: v.contiguous() for k, v in get_peft_model_state_dict(u).items()}

    def sgm(key: str) -> str:  # the module's diffusers name as kohya's SDXL files spell it
        module, _, kind = key.removeprefix("unet.").rpartition(".lora_")
        down = re.match(r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.*)", module)
        up = re.match(r"up_blocks\.(\d+)\.attentions\.(\d+)\.(.*)", module)
        if down:  # layers_per_block 2: three SGM input blocks per diffusers down block, after the conv_in one
            module = f"input_blocks.{1 + 3 * int(down[1]) + int(down[2])}.1.{down[3]}"
        elif up:
            module = f"output_blocks.{3 * int(up[1]) + int(up[2])}.1.{up[3]}"
        module = module.replace("mid_block.attentions.0.", "middle_block.1.")
        return f"lora_unet_{module.replace('.', '_')}.lora_{'down' if kind.startswith('A') else 'up'}.weight"

    second = lora(2)
    kohya = {sgm(k): v for k, v in second.items()}
    kohya |= {k.replace("lora_down.weight", "alpha"): torch.tensor(4.0) for k in list(kohya) if "lora_down" in k}
    save_file(kohya, str(tmp_path / "sgm.safetensors"))
    adapters = HotSwapAdapters(pipe, "sdxl", {}, 2, 4)
    assert adapters.register_live("first", lora(1), 1) == ""
    assert adapters.register("kohya", str(tmp_path / "sgm.safetensors")) == ""
    slot = next(s for s, n in adapters.in_slot.items() if n == "kohya")
    key = "down_blocks.1.attentions.1.transformer_blocks.0.attn1.to_q"
    held = dict(unet.named_parameters())[f"{key}.lora_A.{slot}.weight"]
    assert torch.equal(held[:4], second[f"unet.{key}.lora_A.weight"])


def _fail_hot_swap_at(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """peft's hot-swap raises part-way through the slot's layers (its ``call``-th scaling update), as a device
    error would: tensors before it were copied already."""
    import peft.utils.hotswap as hotswap

    real, calls = hotswap._update_scaling, [0]

    def failing(*args: object, **kwargs: object) -> None:
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError("injected failure in the hot-swap")
        real(*args, **kwargs)

    monkeypatch.setattr(hotswap, "_update_scaling", failing)


def test_a_live_update_whose_hot_swap_fails_part_way_is_half_applied_and_names_the_cause(
        unet_loras: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter is in one slot, and a hot-swap that fails after the check leaves that slot deleted
    by diffusers (or half-written): the worker must restart (``HalfApplied``), not answer a refusal and keep
    serving an adapter that is gone; and the error raised is the hot-swap's, not a KeyError for the lost slot."""
    from safetensors.torch import load_file

    from diffusiond.pipelines.errors import HalfApplied, PipelineError

    state = load_file(str(unet_loras["a"] / "pytorch_lora_weights.safetensors"))
    pipe = compiled_tiny()
    adapters = adapters_for(pipe, {}, 1, target_rank=4)
    assert isinstance(adapters, HotSwapAdapters)
    assert adapters.register_live("live", dict(state), 1) == ""
    base = run(pipe)
    _fail_hot_swap_at(monkeypatch, 5)
    with pytest.raises(HalfApplied, match=r"hot-swap of version 2 of LoRA 'live' failed after it began.*"
                                          r"injected failure in the hot-swap"):
        adapters.update_live("live", {k: v * 3 for k, v in state.items()}, 2)
    assert adapters.versions["live"] == 1 and all(torch.equal(adapters.states["live"][k], v) for k, v in state.items())
    assert adapters.slots == [] and "live" not in adapters.loaded  # nothing claims the lost slot any more
    adapters.activate(())
    assert torch.equal(run(pipe), base)  # what is left of the slot adds nothing
    with pytest.raises(PipelineError, match=r"1 slot\(s\) were lost to failed hot-swaps.*unload and load tiny again"):
        adapters.activate((m.LoraRef("live", 1.0),))


def test_a_hot_swap_that_fails_when_an_adapter_enters_a_slot_loses_only_that_slot(
        unet_loras: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``register`` (and ``activate``, through the same ``_swap``) hitting a hot-swap
    failure. The slot is dropped and the worker serves on with the others, the base model exact; an adapter that
    does not fit the slots (a layer they lack, another size) is refused before anything is copied and costs none."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(unet_loras["a"] / "pytorch_lora_weights.safetensors"))
    odd = {k.replace(".to_q.", ".to_qx.", 1) if ".to_q." in k else k: v for k, v in weights.items()}
    (tmp_path / "odd").mkdir()
    save_file(odd, str(tmp_path / "odd" / "pytorch_lora_weights.safetensors"))
    key = next(k for k in sorted(weights) if ".lora_A." in k)
    wide = dict(weights, **{key: torch.zeros(weights[key].shape[0], weights[key].shape[1] + 8)})
    (tmp_path / "wide").mkdir()
    save_file(wide, str(tmp_path / "wide" / "pytorch_lora_weights.safetensors"))

    # one shape at most (dynamo's recompile bound 1): the retrace after the loss needs the bound to grow;
    # dynamo's caches emptied first, as in a worker, which compiles one model (the UNet class's code is shared)
    torch._dynamo.reset()
    pipe = CompiledPipeline(load_pipeline("tiny", device="cpu", dtype="float32"), "default",
                            {**EAGER_BACKEND, "compile_shapes": "1"})
    adapters = adapters_for(pipe, {}, 2, target_rank=4)
    assert isinstance(adapters, HotSwapAdapters)
    assert adapters.register("a", str(unet_loras["a"])) == ""
    base = run(pipe)
    adapters.activate(A)
    with_a = run(pipe)
    assert "is for a layer the LoRA slots lack" in adapters.register("odd", str(tmp_path / "odd"))
    assert "size mismatch" in adapters.register("wide", str(tmp_path / "wide"))
    assert len(adapters.slots) == 2 and not adapters.lost  # refused before peft touched a slot

    assert not pipe.will_compile(TINY, 1)
    _fail_hot_swap_at(monkeypatch, 3)
    why = adapters.register("b", str(unet_loras["b"]))
    assert "injected failure in the hot-swap" in why
    monkeypatch.undo()
    assert adapters.slots == ["diffusiond_slot0"] and list(adapters.loaded) == ["a"]
    # the slot's modules went, so the next batch traces again, and the worker must say so
    assert pipe.will_compile(TINY, 1)
    before = compilations()
    adapters.activate(())
    assert torch.allclose(run(pipe), base, atol=ADAPTER_ATOL, rtol=0)
    assert compilations() > before and not pipe.will_compile(TINY, 1)
    for loras, want in (((), base), (A, with_a), ((), base)):  # later batches: the other slot and the base model
        adapters.activate(loras)
        assert torch.allclose(run(pipe), want, atol=ADAPTER_ATOL, rtol=0), loras
    assert adapters.register("b", str(unet_loras["b"])) == ""  # into the slot left, "a" out of it
    adapters.activate(B)
    run(pipe)
    with pytest.raises(Exception, match=r"this compiled model has 1 LoRA slots.*1 slot\(s\) were lost"):
        adapters.activate(AB)


async def test_compiled_daemon_swaps_adapters_per_request_like_the_uncompiled_model(
        tmp_path: Path, model_cache: Path, unet_loras: dict[str, Path]) -> None:
    """One daemon, tiny twice: ``plain`` eager and ``fast`` compiled; the same adapters on both."""
    toml = tmp_path / "d.toml"
    toml.write_text(
        'max_batch = 1\nmax_loras = 2\n'
        f'[loras]\na = "{unet_loras["a"]}"\nb = "{unet_loras["b"]}"\nte = "{unet_loras["te"]}"\n'
        '[[models]]\nname = "plain"\nspec = "tiny"\n'
        '[[models]]\nname = "fast"\nspec = "tiny"\ncompile = "default"\nwarmup = "64x64:1"\n'
        'options = { compile_backend = "eager" }\n')
    env = {"DIFFUSIOND_CACHE": str(model_cache), "XDG_STATE_HOME": str(tmp_path / "state")}
    d = Daemon(tmp_path / "d.sock", ["--config", str(toml)], tmp_path / "d.log", env=env)
    d.start(timeout=600)
    try:
        async with http(d.socket) as s:
            async def out(model: str, loras: tuple[m.LoraRef, ...]) -> np.ndarray:
                body = {"model": model, "prompt": "a red fox", "width": 64, "height": 64, "steps": 2, "seed": 3,
                        "output_format": "npy", "output_dtype": "float32",
                        "loras": [{"name": r.name, "weight": r.weight} for r in loras]}
                job = await wait_job(s, (await submit(s, body))["id"], timeout=300)
                assert job["status"] == "succeeded", job
                assert "compiling" not in job["timings_ms"] or model == "plain"  # warmed up: no new graph
                async with s.get(job["outputs"][0]["url"]) as r:
                    return np.load(io.BytesIO(await r.read()))

            fast = [await out("fast", loras) for loras in (A, B, (), A, AB)]
            plain = [await out("plain", loras) for loras in (A, B, (), A, AB)]
            async with s.post("/v1/jobs", json={"model": "fast", "prompt": "x", "width": 64, "height": 64,
                                                "loras": [{"name": "te"}]}) as r:
                te_status, te_answer = r.status, await r.json()
            async with s.post("/v1/loras", json={"name": "big", "path": str(unet_loras["big"])}) as r:
                big_status, big_answer = r.status, await r.json()
            async with s.post("/v1/jobs", json={"model": "fast", "prompt": "x", "width": 64, "height": 64,
                                                "loras": [{"name": "big"}]}) as r:
                big_job_status, big_job = r.status, await r.json()
    finally:
        d.stop()
    for got, want in zip(fast, plain, strict=True):  # eager backend: the uncompiled model's outputs
        assert np.allclose(got.astype(np.float32), want.astype(np.float32), atol=ADAPTER_ATOL, rtol=0)
    assert np.array_equal(fast[0], fast[3])  # the same adapter again: the same output
    distinct = [fast[0], fast[1], fast[2], fast[4]]  # A, B, none, A+B: each its own picture
    assert all(not np.allclose(x, y, atol=ADAPTER_ATOL) for i, x in enumerate(distinct) for y in distinct[i + 1:])
    assert te_status == 400 and te_answer["error"]["field"] == "loras"
    assert "text-encoder weights" in te_answer["error"]["message"]
    assert big_status == 201, big_answer  # it fits the uncompiled model ...
    assert "rank 8 is above 4" in big_answer["unfit"]["fast"]  # ... not the compiled one's slots, and says why
    assert big_job_status == 400 and big_job["error"]["field"] == "loras"
    assert "rank 8 is above 4" in big_job["error"]["message"]
