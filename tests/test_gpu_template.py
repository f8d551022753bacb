"""GPU test of workers forked from the pre-imported template (issue 27's cold start; skipped without CUDA).

``--preimport auto`` forks CUDA workers only once this passes on a GPU: the template must never initialise CUDA
(a process that called cuInit cannot fork children that use it), so a forked worker must make the same pictures
on the GPU as a worker started as a fresh interpreter, and both must start.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from daemonkit import http, shared_daemon, wait_job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)"),
]

JOB = {"prompt": "a lighthouse", "width": 64, "height": 64, "steps": 3, "seed": 5, "output_format": "npy"}


def _picture(tmp: Path, model_cache: Path, preimport: str, *extra: str) -> tuple[bytes, str]:
    folder = tmp / "-".join((preimport, *extra))
    folder.mkdir()
    with shared_daemon(folder, ["--model", "tiny", "--device", "cuda:0", "--dtype", "float16",
                                "--preimport", preimport, "--no-persist", *extra], model_cache) as d:
        async def go() -> bytes:
            async with http(d.socket) as s:
                async with s.post("/v1/jobs", json=JOB) as r:
                    assert r.status == 202, await r.text()
                    job = await wait_job(s, (await r.json())["id"], timeout=300)
                assert job["status"] == "succeeded", job
                async with s.get(job["outputs"][0]["url"]) as r:
                    return await r.read()

        return asyncio.run(go()), d.log()


def test_gpu_a_forked_worker_uses_cuda_and_makes_the_pictures_a_fresh_one_makes(tmp_path: Path,
                                                                               model_cache: Path) -> None:
    forked, log = _picture(tmp_path, model_cache, "on")
    assert "forked from the template" in log, log[-3000:]
    fresh, log = _picture(tmp_path, model_cache, "off")
    assert "forked from the template" not in log
    assert forked == fresh


def test_gpu_a_forked_worker_compiles_and_its_pictures_are_the_eager_ones_up_to_rounding(tmp_path: Path,
                                                                                        model_cache: Path) -> None:
    """The template answered torchao's import-time device queries from NVML (its ``has_triton()`` stays cached
    in the child): the child's compile must still see the real device."""
    eager, _ = _picture(tmp_path, model_cache, "on")
    compiled, log = _picture(tmp_path, model_cache, "on", "--compile", "default")
    assert "forked from the template" in log, log[-3000:]
    a, b = (np.load(io.BytesIO(x)).astype(np.float32) for x in (eager, compiled))
    assert a.shape == b.shape and float(np.abs(a - b).max()) < 0.05
