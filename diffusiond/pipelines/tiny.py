"""The embedded ``tiny`` model: a real Stable Diffusion pipeline with random weights, built in code.

It exists so the daemon, the CLI demo and the tests run the real diffusers code path (tokenizer,
text encoder, UNet, scheduler, VAE, ``from_pretrained``) on a machine with no network and no GPU.
It is a few MB, built deterministically, saved once as safetensors into the diffusiond cache and
then loaded back through the ordinary local-folder loader, so ``tiny`` tests what real models use.
The outputs are structured noise: the weights are random, the numerics are not faked.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from diffusiond.pipelines.base import RequestDefaults
from diffusiond.pipelines.modelcache import BUILT_FOLDERS, ensure_built

# Its folder in the cache (a new name there when the architecture or the saved layout changes).
TINY_VERSION = BUILT_FOLDERS["tiny"]
# CLIP's usual context; the text encoder is so small that 77 positions cost nothing.
MAX_TOKENS = 77
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
# Request defaults: quick on a CPU.
DEFAULTS: RequestDefaults = {"width": 128, "height": 128, "steps": 4, "guidance": 5.0}


def ensure_tiny(cache_dir: Path | None = None) -> Path:
    """Return the tiny model's folder, ``<cache_dir>/models/tiny-v2`` (``cache_dir`` the diffusiond cache
    root, default ``cache_root()``), building it first if no complete one exists, as every model made in
    code is (modelcache.py: atomically, one builder at a time)."""
    return ensure_built(TINY_VERSION, _build, cache_dir)


def _byte_chars() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for bytes (same table as GPT-2 and CLIP)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _write_tokenizer_files(folder: Path) -> int:
    """Write a vocab where every byte is a token (alone and word-final) and no merges.

    With no merges, BPE splits every word into single byte tokens, so any prompt in any script
    tokenizes without unknown tokens. Returns the vocabulary size.
    """
    chars = _byte_chars()
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab[BOS] = len(vocab)
    vocab[EOS] = len(vocab)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return len(vocab)


_PAIR_SCALE = 1e-6  # see passthrough_vae


def passthrough_vae() -> Any:
    """A real ``AutoencoderKL`` whose weights are set, not learned, so that decode(encode(x)) is x
    (to ~1e-6) for images made of 2x2 blocks, and a 2x subsample / nearest upsample of any other.

    Random VAE weights would turn every input image into noise, and then no test could tell
    whether an edit kept its input: with this VAE, image-to-image at a low strength must come
    back close to its input, and inpainting must leave unmasked pixels alone, or the test fails.
    Latents are the image's RGB (and a zero fourth channel), at half the resolution.

    How, with the architecture unchanged: every ResNet's second conv and every attention's output
    projection are zero, so each block passes its input through; down/upsampling convs pick one
    tap; the two GroupNorm+SiLU stages that every path crosses are made linear by carrying each
    value as a pair (a*v, -a*v): each group's mean is then exactly 0, with a tiny ``a`` its variance
    is far below the norm's eps, so the norm is a fixed gain of 1/sqrt(eps), and
    SiLU(z) - SiLU(-z) = z exactly, which the next conv takes. The log-variance is -30, so sampling
    the latent distribution adds noise of ~3e-7.
    """
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(32, 64),  # two levels: vae_scale_factor 2, 64x64 images denoise 32x32 latents
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=16,  # groups of 2 (decoder) and 4 (encoder) channels: whole (v, -v) pairs
        sample_size=64,
        scaling_factor=1.0,
    )
    a = _PAIR_SCALE
    gain = 1.0 / (a * 1000.0)  # undoes a and the norm's 1/sqrt(1e-6)

    def eye(conv: torch.nn.Conv2d, tap: int) -> None:
        w = conv.weight
        w.zero_()
        if conv.bias is not None:
            conv.bias.zero_()
        for c in range(min(w.shape[0], w.shape[1])):
            w[c, c, tap, tap] = 1

    def split(conv: torch.nn.Conv2d, n: int) -> None:  # n values -> pairs (a v, -a v)
        eye(conv, 1)
        conv.weight.zero_()
        for k in range(n):
            conv.weight[2 * k, k, 1, 1] = a
            conv.weight[2 * k + 1, k, 1, 1] = -a

    def join(conv: torch.nn.Conv2d, n: int) -> None:  # pairs -> n values
        eye(conv, 1)
        conv.weight.zero_()
        for k in range(n):
            conv.weight[k, 2 * k, 1, 1] = gain
            conv.weight[k, 2 * k + 1, 1, 1] = -gain

    with torch.no_grad():
        for m in vae.modules():
            if type(m).__name__ == "ResnetBlock2D":
                m.conv2.weight.zero_()
                m.conv2.bias.zero_()
                if m.conv_shortcut is not None:
                    eye(m.conv_shortcut, 0)
            elif type(m).__name__ == "Attention":
                m.to_out[0].weight.zero_()
                m.to_out[0].bias.zero_()
        eye(vae.encoder.down_blocks[0].downsamplers[0].conv, 1)
        eye(vae.decoder.up_blocks[0].upsamplers[0].conv, 1)
        split(vae.encoder.conv_in, 3)
        join(vae.encoder.conv_out, 3)
        vae.encoder.conv_out.bias[4:] = -30.0  # log-variance: a near-deterministic latent
        split(vae.decoder.conv_in, 4)
        join(vae.decoder.conv_out, 3)
        eye(vae.quant_conv, 0)
        eye(vae.post_quant_conv, 0)
        for norm in (vae.encoder.conv_norm_out, vae.decoder.conv_norm_out):
            norm.weight.fill_(1)
            norm.bias.zero_()
    return vae


def _build(out: Path, *, inpaint: bool = False) -> None:
    """Build the pipeline with fixed seeds and save it (safetensors only) into ``out``."""
    from diffusers import (
        EulerDiscreteScheduler,
        StableDiffusionInpaintPipeline,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    tok_src = out / ".tokenizer-src"
    vocab_size = _write_tokenizer_files(tok_src)
    tokenizer = CLIPTokenizer.from_pretrained(str(tok_src), model_max_length=MAX_TOKENS)
    # fork_rng: building must not disturb the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = UNet2DConditionModel(
            sample_size=32,
            in_channels=9 if inpaint else 4,
            out_channels=4,
            block_out_channels=(32, 64),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=32,
        )
        torch.manual_seed(0)
        vae = passthrough_vae()
        torch.manual_seed(0)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=vocab_size,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=MAX_TOKENS,
                layer_norm_eps=1e-5,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        timestep_spacing="trailing",  # few-step friendly: the first step starts from pure noise
        steps_offset=1,
    )
    cls = StableDiffusionInpaintPipeline if inpaint else StableDiffusionPipeline
    pipe = cls(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        image_encoder=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(str(out), safe_serialization=True)
    # Keep the plain vocab/merges too: any transformers version can rebuild the tokenizer from them.
    for name in ("vocab.json", "merges.txt"):
        target = out / "tokenizer" / name
        if not target.exists():
            shutil.copyfile(tok_src / name, target)
    shutil.rmtree(tok_src)
