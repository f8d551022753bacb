"""Previews of models whose latents come packed into tokens and that have no factors here (Qwen-Image,
Chroma, FLUX.2): a preview decoder either fits them when the model loads or is refused then, with
the reason, never by the first preview failing its job.

Qwen-Image's VAE names its channels ``z_dim`` (no ``latent_channels``), which the load's channel
check used to skip; its tokens are FLUX's layout, which the previews could not unpack because the
class is not named Flux. The layout is now found by asking the pipeline's own ``_pack_latents`` to
pack a probe (real diffusers classes here), and the last test serves ``random:qwen-image`` built
small with a 16-channel tiny autoencoder, end to end on the CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import AutoencoderTiny, ChromaPipeline, Flux2Pipeline, QwenImagePipeline, StableDiffusion3Pipeline

from diffusiond.ipc.messages import BatchParams, RequestSpec
from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline
from diffusiond.pipelines.errors import PipelineError
from diffusiond.pipelines.previews import TinyAutoencoderPreviewer, packing_of
from diffusiond.pipelines.registry import load_pipeline


class _Config:
    def __init__(self, **values: int) -> None:
        self.__dict__.update(values)


def stand_in(real: type, **vae_config: int) -> Any:
    """An object of the real pipeline's name and ``_pack_latents``, with a VAE config saying ``vae_config``."""
    cls = type(real.__name__, (), {"_pack_latents": real.__dict__.get("_pack_latents"), "vae_scale_factor": 8})
    pipe = cls()
    pipe.vae = type("Vae", (), {"config": _Config(**vae_config)})()
    return pipe


@pytest.fixture(scope="module")
def taes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Small random-weight AutoencoderTiny folders decoding 4, 16 and 32-channel latents."""
    root = tmp_path_factory.mktemp("taes")
    out = {}
    for channels in (4, 16, 32):
        torch.manual_seed(channels)
        AutoencoderTiny(encoder_block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 4,
                        latent_channels=channels).save_pretrained(root / str(channels))
        out[channels] = root / str(channels)
    return out


@pytest.mark.parametrize(("real", "packing"), [
    (QwenImagePipeline, "flux"), (ChromaPipeline, "flux"),  # FLUX's 2x2 patches, under other names
    (Flux2Pipeline, None),  # named Flux, but another layout (and another _pack_latents)
    (StableDiffusion3Pipeline, "spatial"),  # latents as (B, C, h, w): nothing to unpack
])
def test_the_token_layout_is_the_pipelines_own_packing(real: type, packing: str | None) -> None:
    assert packing_of(stand_in(real, latent_channels=16), None) == packing


def test_a_decoder_for_packed_latents_is_checked_at_load_by_z_dim_and_layout(taes: dict[int, Path]) -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    qwen = stand_in(QwenImagePipeline, z_dim=16)  # AutoencoderKLQwenImage's config: z_dim, no latent_channels
    with pytest.raises(PipelineError, match="decodes 4-channel latents; the model makes 16"):
        TinyAutoencoderPreviewer(qwen, str(taes[4]), cpu, f32)
    with pytest.raises(PipelineError, match=r"Flux2Pipeline packs its latents into tokens in a layout previews do "
                                            r"not unpack.*without preview_decoder"):
        TinyAutoencoderPreviewer(stand_in(Flux2Pipeline, latent_channels=32), str(taes[32]), cpu, f32)
    previewer = TinyAutoencoderPreviewer(qwen, str(taes[16]), cpu, f32)
    params = BatchParams(width=128, height=64, steps=1, guidance=1.0)
    latents = torch.randn(2, 16, 8, 16)
    packed = QwenImagePipeline._pack_latents(latents, 2, 16, 8, 16)
    (pic,) = previewer(packed, [1], params, [64])
    assert tuple(pic.shape) == (32, 64, 3) and pic.dtype == torch.uint8
    assert torch.equal(pic, previewer(latents, [1], params, [64])[0]), "not the latents diffusers packed"


def test_qwen_image_previews_through_its_decoder_from_the_first_step(
        taes: dict[int, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from test_presets import SMALL_NEW

    from diffusiond.pipelines.preset_tables import PRESETS

    preset = SMALL_NEW["qwen-image"]
    monkeypatch.setitem(PRESETS, preset.name, preset)
    monkeypatch.setenv("DIFFUSIOND_CACHE", str(tmp_path))
    with pytest.raises(PipelineError, match="decodes 4-channel latents; the model makes 16"):
        load_pipeline(f"random:{preset.name}", options={"preview_decoder": str(taes[4]), "save": "0"})
    pipe = load_pipeline(f"random:{preset.name}", options={"preview_decoder": str(taes[16]), "save": "0"})
    assert isinstance(pipe, DiffusersPipeline) and pipe.capabilities.previews
    shown: list[tuple[int, int, tuple[int, ...]]] = []
    wants = RequestSpec(request_id="r", prompt="a red fox", seed=1, preview_every=1, preview_max_side=32)
    (image,) = pipe.run(BatchParams(width=64, height=64, steps=2, guidance=4.0), [wants], lambda _s, _t: True,
                        lambda step, _total, pics: shown.extend((step, k, tuple(p.shape)) for k, p in pics))
    assert tuple(image.shape) == (3, 64, 64)
    assert shown == [(1, 0, (32, 32, 3))]  # after step 1 of 2; the last step's picture is the output
