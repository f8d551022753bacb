"""The text an encoded output carries about itself (PNG tEXt, an MP4's comment): the request's fields,
the adapters' versions and what made the output approximate, so a file alone says how it was made."""

from __future__ import annotations

from diffusiond.daemon.core.jobs import Item


def file_metadata(item: Item) -> dict[str, str]:
    """What an encoded output says about itself (PNG tEXt, MP4 comment): enough to reproduce it."""
    r = item.job.request
    meta = {"prompt": r.prompt, "model": r.model, "seed": str(item.seed), "steps": str(r.steps),
            "guidance_scale": f"{r.guidance:g}", "size": f"{r.width}x{r.height}", "software": "diffusiond"}
    if r.negative_prompt:
        meta["negative_prompt"] = r.negative_prompt
    if r.loras:  # as A1111 writes them in prompts: name:weight
        meta["loras"] = ", ".join(f"{name}:{weight:g}" for name, weight in r.loras)
    if r.controls:  # name(@mode):scale, and the step range and preprocess where they are not the defaults
        meta["control"] = ", ".join(
            n + (f"@{m}" if m is not None else "") + f":{s:g}" + (f"[{a:g}-{b:g}]" if (a, b) != (0.0, 1.0) else "")
            + (f" {p}" if p != "none" else "") for n, s, a, b, p, m in r.controls)
    if r.ip_adapters:  # name:scale and the reference image's digest (the image itself is not kept)
        meta["ip_adapter"] = ", ".join(f"{n}:{s:g} {d}" for n, s, d in r.ip_adapters)
    if r.hires or r.upscale:  # the size the output has, and how it got there
        meta["output_size"] = "{}x{}".format(*r.output_size)
        if r.hires:
            h = r.hires
            meta["hires"] = f"{h.width}x{h.height}, strength {h.strength:g}, {h.steps} steps, " + (
                h.upscaler or "bicubic")
        if r.upscale:
            meta["upscale"] = f"{r.upscale.name}:{r.upscale.scale:g}"
    # the output's own batch's versions: another output of the same job may have run either side of an update
    if item.lora_versions:
        meta["lora_versions"] = ", ".join(f"{name}:{v}" for name, v in sorted(item.lora_versions.items()))
    if item.weight_versions:
        meta["weight_versions"] = ", ".join(f"{c}:{v}" for c, v in sorted(item.weight_versions.items()))
    if r.audio_rate:  # the sound track made with it (muxed in an mp4; GET .../audio for every format)
        meta["audio"] = f"{r.audio_rate} Hz"
    if item.job.approximations:  # the output is not the model's exact one: say how it differs
        meta["approximations"] = ", ".join(item.job.approximations)
    if item.job.compiled:
        meta["compiled"] = item.job.compiled
    if item.job.attention:
        meta["attention"] = item.job.attention
    return meta
