"""``offload=stream`` (issue 28): the block streamer driven in process on the CPU, where the daemon refuses it.

On a CPU the streamer runs the same bookkeeping as on CUDA with plain copies and no streams: the ring's slots,
the cyclic order across steps and calls, the hooks that point a block's parameters into its slot and back.
So its exactness is checked here against the model without streaming (byte-equal outputs, for two calls in a
row, for several numbers of resident blocks and ring depths, K=0 and d=1 included), and so is what it keeps
where. tests/test_gpu_residency.py checks the same bytes on CUDA.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from diffusiond.pipelines import offload, stream_plan
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.streaming import BlockStreamer, blocks_of, weights_changed

# the tiny-flux transformer's widths with more blocks, so the ring has something to cycle through
DEEP = {"num_layers": 3, "num_single_layers": 4}


@pytest.fixture(scope="module")
def flux(model_cache: Path) -> Any:
    from diffusers import FluxPipeline

    from diffusiond.pipelines.tiny_flux import ensure_tiny_flux

    pipe = FluxPipeline.from_pretrained(str(ensure_tiny_flux()))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def deep(flux: Any) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    from diffusiond.pipelines.tiny_flux import TRANSFORMER

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return FluxTransformer2DModel(**{**TRANSFORMER, **DEEP}).eval()


CALLS = ((1, 3), (2, 2))  # (seed, steps): two calls in a row, the second with fewer steps


def _call(flux: Any, transformer: torch.nn.Module, seed: int, steps: int, inference: bool = False) -> torch.Tensor:
    from diffusers import FluxPipeline

    pipe = FluxPipeline(**{**flux.components, "transformer": transformer})
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode(inference):
        out = pipe(prompt="a lighthouse", height=64, width=64, num_inference_steps=steps, max_sequence_length=32,
                   generator=torch.Generator().manual_seed(seed), output_type="pt")
    return out.images.clone()


@pytest.fixture(scope="module")
def reference(flux: Any, deep: torch.nn.Module) -> list[torch.Tensor]:
    return [_call(flux, deep, seed, steps) for seed, steps in CALLS]


@pytest.mark.parametrize(("resident", "depth"), [(0, 1), (0, 2), (0, 3), (3, 2), (5, 3), (2, 4), (6, 1), (7, 3)])
def test_streamed_outputs_are_byte_equal_to_the_resident_model_across_steps_and_calls(
        flux: Any, deep: torch.nn.Module, reference: list[torch.Tensor], resident: int, depth: int) -> None:
    transformer = copy.deepcopy(deep)
    streamer = BlockStreamer(transformer, "cpu", resident, depth)
    streamed = len(blocks_of(transformer)) - resident
    assert len(streamer.blocks) == streamed and streamer.plan.depth == min(depth, streamed)
    # the first call in inference mode, as the worker runs it; the second without, as a script might
    got = [_call(flux, transformer, seed, steps, inference=i == 0) for i, (seed, steps) in enumerate(CALLS)]
    for want, have in zip(reference, got, strict=True):
        assert torch.equal(want, have)
    forwards = sum(steps for _, steps in CALLS)
    # the ring filled once, then one copy per block run: the next forward's first blocks come in after this one's
    assert streamer.copies == (streamer.plan.depth + streamed * forwards if streamed else 0)


def test_a_unets_down_and_up_blocks_stream_exactly(model_cache: Path) -> None:
    """A UNet's lists run down_blocks, then its mid_block (resident: not a list), then up_blocks: the order
    they were registered in, so the ring's order is theirs; classifier-free guidance batches both halves."""
    from diffusers import StableDiffusionPipeline

    from diffusiond.pipelines.tiny import ensure_tiny

    pipe = StableDiffusionPipeline.from_pretrained(str(ensure_tiny()), safety_checker=None)

    def call(unet: torch.nn.Module, seed: int) -> torch.Tensor:
        p = StableDiffusionPipeline(**{**pipe.components, "unet": unet})
        p.set_progress_bar_config(disable=True)
        return p(prompt="a lighthouse", height=64, width=64, num_inference_steps=2, output_type="pt",
                 generator=torch.Generator().manual_seed(seed)).images

    want = [call(pipe.unet, seed) for seed in (1, 2)]
    assert list(blocks_of(pipe.unet)) == ["down_blocks.0", "down_blocks.1", "up_blocks.0", "up_blocks.1"]
    for resident, depth in ((0, 1), (1, 2), (2, 3)):
        unet = copy.deepcopy(pipe.unet)
        BlockStreamer(unet, "cpu", resident, depth)
        assert all(torch.equal(a, call(unet, seed)) for a, seed in zip(want, (1, 2), strict=True)), resident


def test_streamed_parameters_point_into_their_slot_only_while_their_block_runs(
        flux: Any, deep: torch.nn.Module) -> None:
    transformer = copy.deepcopy(deep)
    streamer = BlockStreamer(transformer, "cpu", 3, 2)
    plan = streamer.plan
    assert [b.name for b in streamer.blocks] == [  # spread over the lists (laid end to end in name order)
        "transformer_blocks.0", "transformer_blocks.2", "single_transformer_blocks.0", "single_transformer_blocks.2"]
    assert plan.slot == max(b.size for b in streamer.blocks) and plan.ring == 2 * plan.slot
    assert streamer.host_bytes == sum(b.size for b in streamer.blocks)
    seen: list[str] = []

    def inside(block: Any, module: torch.nn.Module, args: Any) -> None:
        ring = streamer.ring_range()
        for t, home in zip(block.tensors, block.homes, strict=True):
            p = t.owner._parameters[t.name]
            assert ring[0] <= p.data_ptr() < ring[1], f"{block.name}.{t.name} is not in the ring while it runs"
            assert torch.equal(p.data, home), f"{block.name}.{t.name} holds another block's bytes"
        seen.append(block.name)

    for b in streamer.blocks:  # registered after the streamer's own: it runs once the slot is pointed at
        b.module.register_forward_pre_hook(lambda m, a, b=b: inside(b, m, a))
    _call(flux, transformer, 1, 2)
    assert seen == [b.name for b in streamer.blocks] * 2
    host, ring = streamer.host_range(), streamer.ring_range()
    for b in streamer.blocks:
        for p in b.module.parameters():
            assert host[0] <= p.data_ptr() < host[1] and not ring[0] <= p.data_ptr() < ring[1], b.name
    for block in streamer.resident:
        assert all(not host[0] <= p.data_ptr() < host[1] for p in block.parameters())


def test_offload_stream_on_a_cpu_is_refused_for_users(flux: Any) -> None:
    with pytest.raises(PipelineError, match="offload=stream needs an accelerator device"):
        offload.apply_offload(flux, "stream", torch.device("cpu"), 1)


def test_the_whole_offload_path_counts_what_it_keeps_on_the_device(flux: Any, deep: torch.nn.Module,
                                                                    reference: list[torch.Tensor]) -> None:
    """``offload._stream`` is what ``apply_offload`` runs on an accelerator: the streamer on the denoiser, leaf
    group offloading on the rest. Onto the CPU itself it runs the same, and counts the same figure."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline(**{**copy.deepcopy(flux.components), "transformer": copy.deepcopy(deep)})
    pipe.set_progress_bar_config(disable=True)
    blocks, always, others = offload.stream_sizes(pipe)
    streamer = offload._stream(pipe, torch.device("cpu"), 4)
    counted = offload.device_bytes(pipe, "stream")
    assert counted == stream_plan.plan(blocks, always, others, 4).device_bytes
    assert counted == always + sum(sum(v) for k, v in blocks.items() if k not in streamer.plan.streamed) \
        + streamer.plan.ring + others
    assert torch.equal(_call(pipe, pipe.transformer, *CALLS[0]), reference[0])
    with pytest.raises(PipelineError, match="resident_blocks=N"):
        offload._stream(pipe, torch.device("cpu"), None)


def test_a_weight_written_in_place_reaches_the_next_forward(flux: Any, deep: torch.nn.Module) -> None:
    """A live update writes a streamed weight in its host home; the ring had already copied the next call's
    first blocks from the old value, which ``weights_changed`` drops (worker/weights.py calls it)."""
    updated = copy.deepcopy(deep)
    streamed = [copy.deepcopy(deep), copy.deepcopy(deep)]
    streamers = [BlockStreamer(t, "cpu", 4, 2) for t in streamed]
    for t in streamed:
        _call(flux, t, 1, 2)
    first = streamers[0].blocks[0].name  # copied into the ring at the end of the last forward
    for t in (updated, *streamed):
        with torch.no_grad():
            blocks_of(t)[first].norm1.linear.weight.mul_(1.5)
    want = _call(flux, updated, 2, 2)
    weights_changed(streamed[0])
    assert torch.equal(_call(flux, streamed[0], 2, 2), want)
    assert not torch.equal(_call(flux, streamed[1], 2, 2), want), "without it the first forward used the old weight"


# the bookkeeping on a toy denoiser whose forward can skip blocks, raise, or run them out of order -------------
class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(5))
        self.skip: set[int] = set()
        self.order: list[int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for i in self.order if self.order is not None else range(len(self.blocks)):
            if i not in self.skip:
                x = torch.tanh(self.blocks[i](x))
        return x


@pytest.fixture
def toys() -> Iterator[tuple[Toy, Toy, BlockStreamer]]:
    resident, streamed = Toy(), Toy()
    with torch.no_grad():
        yield resident, streamed, BlockStreamer(streamed, "cpu", 1, 2)


def test_skipped_blocks_and_a_forward_that_raises_keep_the_ring_in_step(toys: tuple[Toy, Toy, BlockStreamer]
                                                                        ) -> None:
    resident, streamed, streamer = toys
    x = torch.randn(3, 8)
    for skip in ({1, 3}, {0, 4}, set(), {2}):
        resident.skip = streamed.skip = skip
        assert torch.equal(resident(x), streamed(x)), skip
    boom = streamer.blocks[1].module.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ValueError, match="boom"):
        streamed(x)
    boom.remove()
    host = streamer.host_range()
    assert all(host[0] <= p.data_ptr() < host[1] for b in streamer.blocks for p in b.module.parameters())
    resident.skip = streamed.skip = set()
    assert torch.equal(resident(x), streamed(x))
    streamer.leave()  # the model sleeps: the ring is freed, and made and filled again by the next forward
    assert streamer.ring_range() == (0, 0)
    streamer.come_back()
    before = streamer.copies
    assert torch.equal(resident(x), streamed(x))
    assert streamer.copies - before == streamer.plan.depth + len(streamer.blocks)


def test_a_block_out_of_order_is_an_error_naming_it_and_the_next_forward_is_exact(
        toys: tuple[Toy, Toy, BlockStreamer]) -> None:
    resident, streamed, streamer = toys
    x = torch.randn(3, 8)
    assert [b.name for b in streamer.blocks] == ["blocks.0", "blocks.1", "blocks.3", "blocks.4"]
    streamed.order = [4, 0]
    with pytest.raises(PipelineError, match=r"block blocks\.0 ran out of order \(after blocks\.4\)"):
        streamed(x)
    streamed.order = None
    assert torch.equal(resident(x), streamed(x))


def test_a_forward_with_gradients_is_refused() -> None:
    toy = Toy()
    BlockStreamer(toy, "cpu", 0, 2)
    with torch.enable_grad(), pytest.raises(PipelineError, match="inference only"):
        toy(torch.randn(1, 8))


def test_what_cannot_be_streamed_is_refused_naming_it(flux: Any, deep: torch.nn.Module) -> None:
    with pytest.raises(PipelineError, match="resident_blocks=8: FluxTransformer2DModel has 7 blocks; give 0 to 7"):
        BlockStreamer(copy.deepcopy(deep), "cpu", 8)
    with pytest.raises(PipelineError, match="a ring depth of 0 slots"):
        BlockStreamer(copy.deepcopy(deep), "cpu", 0, 0)
    with pytest.raises(PipelineError, match="AutoencoderKL has no lists of blocks"):
        BlockStreamer(flux.vae, "cpu", 0)
    shared = Toy()
    shared.blocks[3].weight = shared.blocks[1].weight
    with pytest.raises(PipelineError, match=r"blocks\.3 shares a tensor with blocks\.1"):
        BlockStreamer(shared, "cpu", 0)
    tied = Toy()
    tied.blocks[0].bias = tied.proj.bias
    with pytest.raises(PipelineError, match=r"blocks\.0 shares a tensor with the rest of Toy"):
        BlockStreamer(tied, "cpu", 0)
    strided = Toy()
    strided.blocks[2].weight = torch.nn.Parameter(torch.randn(8, 8).t())
    with pytest.raises(PipelineError, match=r"blocks\.2\.weight is not contiguous in memory"):
        BlockStreamer(strided, "cpu", 0)
    cast = copy.deepcopy(deep)
    cast.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    with pytest.raises(PipelineError, match="already carries hooks that move or cast its weights"):
        BlockStreamer(cast, "cpu", 0)


def test_the_planner_spreads_the_streamed_blocks_and_keeps_the_most_that_fit() -> None:
    names = [f"a.{i}" for i in range(4)] + [f"b.{i}" for i in range(8)]
    assert stream_plan.streamed_blocks(names, 12) == ()
    assert stream_plan.streamed_blocks(names, 9) == ("a.2", "b.2", "b.6")
    assert stream_plan.streamed_blocks(reversed(names), 0) == tuple(names)  # order given does not matter
    with pytest.raises(ValueError, match="resident_blocks=13: the denoiser has 12 blocks"):
        stream_plan.streamed_blocks(names, 13)
    blocks = {n: [100_000, 24] for n in names}  # each block 100,024 bytes, 100,864 in a slot (each tensor aligned)
    p = stream_plan.plan(blocks, always=100, others=10, resident_blocks=6)
    assert (p.depth, p.slot, p.resident, p.streamed_bytes) == (3, 100_864, 6 * 100_024, 6 * 100_024)
    assert p.device_bytes == 100 + 6 * 100_024 + 3 * 100_864 + 10
    # with 3 slots, streaming pays from the fourth block streamed on: 9 resident need more than all 12
    assert stream_plan.plan(blocks, 100, 10, 9).device_bytes > stream_plan.plan(blocks, 100, 10, 12).device_bytes
    chosen, fits = stream_plan.choose(blocks, 100, 10, lambda d: d <= p.device_bytes)
    assert fits and chosen.resident_blocks == 6
    least, fits = stream_plan.choose(blocks, 100, 10, lambda d: False)
    assert not fits and least.resident_blocks == 0
    small = {n: [100, 24] for n in names}  # blocks smaller than a slot's alignment: the least keeps them all
    assert stream_plan.least(small, 100, 10).resident_blocks == 12
