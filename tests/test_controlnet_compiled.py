"""ControlNets and IP-Adapters on a ``--compile``d model (report 30 #3): served, and run eager.

They used to be unfit for every compiled model ("not a plain diffusers text-to-image pipeline (compiled
or synthetic)"), so the setup GPU users benchmark with lost them. Their batches run on the compiled
model's own diffusers pipeline with its modules eager (controlnet.py's ``eager``): the compiled graphs
stay those of the plain batches, and nothing is compiled (nor announced as compiling) for them.
torch.compile runs with the ``eager`` backend here, as in tests/test_compile.py, so a compiled plain
batch and an eager one give the same output bit for bit, and each graph compiled is still counted.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from controlkit import png
from daemonkit import get, http, shared_daemon, submit, wait_job

from diffusiond.ipc import messages as m
from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.compile import CompiledPipeline, compilations
from diffusiond.pipelines.controlnet import ControlNets
from diffusiond.pipelines.ip_adapter import IpAdapters

EAGER_BACKEND = {"compile_backend": "eager"}
REQS = [m.RequestSpec(request_id="a", prompt="a red barn", seed=3)]


def _picture(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)


def _outputs(pipeline: object, controlnet_dir: Path, ip_adapter_file: Path) -> list[torch.Tensor]:
    """One ControlNet batch, one IP-Adapter batch and one batch with both, on ``pipeline``."""
    cns = ControlNets(pipeline, {"edges": str(controlnet_dir)})
    ips = IpAdapters(pipeline, {"style": (str(ip_adapter_file), str(ip_adapter_file.parent / "image_encoder"))})
    assert cns.errors == {} and ips.errors == {}
    control = (m.ControlRef("edges", 1.0, 0.0, 1.0, "d1"),)
    ip = (m.IpAdapterRef("style", 0.8, "d2"),)
    base = m.BatchParams(width=64, height=64, steps=2, guidance=5.0)
    done = lambda _s, _t: True  # noqa: E731
    with torch.inference_mode():
        controlled = cns.run(_with(base, controls=control), REQS, [[_picture(1)]], done)
        referenced = ips.run(_with(base, ip_adapters=ip), REQS, [[_picture(2)]], done)
        both = ips.run(_with(base, controls=control, ip_adapters=ip), REQS, [[_picture(2)]], done,
                       controls=[[_picture(1)]], controlnets=cns)
        ips.release()
    return [*controlled, *referenced, *both]


def _with(params: m.BatchParams, **changes: object) -> m.BatchParams:
    import msgspec

    return msgspec.structs.replace(params, **changes)


def test_control_and_reference_batches_of_a_compiled_model_run_eager_with_its_output(
        model_cache: Path, controlnet_dir: Path, ip_adapter_file: Path) -> None:
    want = _outputs(load_pipeline("tiny", device="cpu", dtype="float32"), controlnet_dir, ip_adapter_file)
    compiled = CompiledPipeline(load_pipeline("tiny", device="cpu", dtype="float32"), "default", EAGER_BACKEND)
    plain = m.BatchParams(width=64, height=64, steps=2, guidance=5.0)
    with torch.inference_mode():
        compiled.run(plain, REQS, lambda _s, _t: True)  # the plain shape is compiled
    before = compilations()
    got = _outputs(compiled, controlnet_dir, ip_adapter_file)
    assert compilations() == before, "a ControlNet or IP-Adapter batch compiled a graph"
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert not compiled.will_compile(_with(plain, width=96, controls=(m.ControlRef("edges", 1.0, 0.0, 1.0, "d"),)), 1)
    assert compiled.will_compile(_with(plain, width=96), 1)  # a plain batch of that size would compile


@pytest.fixture(scope="module")
def sock(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, controlnet_dir: Path,
         ip_adapter_file: Path) -> object:
    root = tmp_path_factory.mktemp("compiled-control")
    toml = root / "d.toml"
    toml.write_text('max_batch = 1\n[[models]]\nname = "fast"\nspec = "tiny"\ncompile = "default"\n'
                    'warmup = "64x64:1"\noptions = { compile_backend = "eager" }\n'
                    f'[controlnets]\nedges = "{controlnet_dir}"\n[ip_adapters]\nstyle = "{ip_adapter_file}"\n')
    with shared_daemon(root, ["--config", str(toml)], model_cache) as d:
        yield d.socket


async def test_a_compiled_model_serves_controlnets_and_ip_adapters(sock: Path) -> None:
    async with http(sock) as s:
        _, controlnets = await get(s, "/v1/controlnets")
        _, adapters = await get(s, "/v1/ip-adapters")
        body = {"model": "fast", "prompt": "a red fox", "width": 64, "height": 64, "steps": 2, "seed": 1,
                "control": [{"name": "edges", "image": png(1)}],
                "ip_adapter": [{"name": "style", "image": png(2)}]}
        job = await wait_job(s, (await submit(s, body))["id"], timeout=300)
    assert controlnets["data"][0]["models"] == ["fast"], controlnets
    assert adapters["data"][0]["models"] == ["fast"], adapters
    assert job["status"] == "succeeded", job
    assert "compiling" not in job["timings_ms"]  # run eager: nothing compiled for it
