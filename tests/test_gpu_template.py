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
from test_gpu import COMPILE_TOLERANCE_LEVELS, COMPILE_TOLERANCE_MEAN

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)"),
]

JOB = {"prompt": "a lighthouse", "width": 64, "height": 64, "steps": 3, "seed": 5, "output_format": "npy"}


def _picture(tmp: Path, model_cache: Path, preimport: str, *extra: str, dtype: str = "float16") -> tuple[bytes, str]:
    folder = tmp / "-".join((preimport, dtype, *extra))
    folder.mkdir()
    with shared_daemon(folder, ["--model", "tiny", "--device", "cuda:0", "--dtype", dtype,
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
    in the child): the child's compile must still see the real device. In float32, where test_gpu.py's bounds on
    compile's rounding hold for this model (in float16 a fused kernel moved single pixels by 16 levels on an H100)."""
    eager, _ = _picture(tmp_path, model_cache, "on", dtype="float32")
    compiled, log = _picture(tmp_path, model_cache, "on", "--compile", "default", dtype="float32")
    assert "forked from the template" in log, log[-3000:]
    assert "torch's compiler imported" in log, log[-3000:]  # and imported without CUDA (issue 31)
    a, b = (np.load(io.BytesIO(x)).astype(np.int16) for x in (eager, compiled))  # pixel levels, 0..255
    diff = np.abs(a - b)
    assert a.shape == b.shape
    assert diff.max() <= COMPILE_TOLERANCE_LEVELS and diff.mean() <= COMPILE_TOLERANCE_MEAN, (diff.max(), diff.mean())
