"""An IP-Adapter load that fails midway (report 30 #9): the denoiser gets its own processors back and the
next batch naming the same adapters loads them again.

``activate`` used to note the adapters as loaded before diffusers' ``load_ip_adapter`` ran, so after a
load that raised (an out-of-memory on a busy card) the next batch with the same list skipped the load
and ran on a half-patched denoiser. The failure is diffusers' own load, run to the end and then made to
raise, as one that ran out of memory after swapping the processors would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.ip_adapter import IpAdapters


def test_a_failed_load_leaves_the_denoiser_as_it_was_and_the_next_batch_loads_again(
        model_cache: Path, ip_adapter_file: Path) -> None:
    pipeline: Any = load_pipeline("tiny", device="cpu", dtype="float32")
    ips = IpAdapters(pipeline, {"style": (str(ip_adapter_file), str(ip_adapter_file.parent / "image_encoder"))})
    assert ips.errors == {}
    pipe = pipeline.pipe
    own = dict(pipe.unet.attn_processors)
    load, calls = pipe.load_ip_adapter, []

    def out_of_memory(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        load(*args, **kwargs)  # the processors are swapped ...
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected: out of memory while loading the IP-Adapter")  # ... then it fails

    pipe.load_ip_adapter = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        ips.activate(("style",))
    assert ips.current is None
    assert dict(pipe.unet.attn_processors) == own, "the denoiser kept the half-loaded adapter's processors"
    assert pipe.unet.encoder_hid_proj is None
    ips.activate(("style",))
    assert len(calls) == 2, "the next batch with the same adapters did not load them"
    assert ips.current == ("style",) and pipe.unet.encoder_hid_proj is not None
    ips.release()
    assert dict(pipe.unet.attn_processors) == own
