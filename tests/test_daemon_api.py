"""The HTTP API of docs/api.md against a real daemon process: ``diffusiond serve`` on a temporary Unix
socket with real worker subprocesses, talked to over the socket by aiohttp and by the official
``openai`` client.

One daemon serves the whole module (``tiny`` on two workers; ``slow``, a synthetic model whose
batches take about 1.5 s, for tests that need a job to be running while they look at it; and
``video``, a synthetic text-to-video model). The queue-full test, which needs a daemon with a one-job
queue, is test_daemon_api_queue.py's; the requests and checks the tests make are apikit.py's.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from apikit import FAST, IMAGES, SIZE, STEPS, fetch, get_json, png, post, run_job, same_image
from daemonkit import Daemon, http, shared_daemon, sse

CONFIG = """
[[models]]
name = "tiny"
spec = "tiny"
workers = 2

[[models]]
name = "slow"
spec = "synthetic:compute_ms=1500"
workers = 1

[[models]]
name = "video"
spec = "synthetic:task=video,compute_ms=50"
workers = 1
"""


@pytest.fixture(scope="module")
def api_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    """One daemon for the module, configured through a TOML file (``--config``)."""
    tmp = tmp_path_factory.mktemp("api")
    config = tmp / "diffusiond.toml"
    config.write_text(CONFIG)
    with shared_daemon(tmp, ["--config", str(config), "--max-batch", "4", "--job-timeout", "120"], model_cache) as d:
        yield d


@pytest.fixture
def sock(api_daemon: Daemon) -> Path:
    assert api_daemon.proc is not None and api_daemon.proc.poll() is None, api_daemon.log()
    return api_daemon.socket


# OpenAI-shaped endpoint -----------------------------------------------------------------------
async def test_images_generations_b64_json_is_a_png_of_the_asked_size(sock: Path) -> None:
    async with http(sock) as s:
        status, body, _ = await post(s, "/v1/images/generations", {**IMAGES, "prompt": "a fox", "seed": 3})
    assert status == 200, body
    assert isinstance(body["created"], int)
    (entry,) = body["data"]
    assert entry["seed"] == 3 and entry["revised_prompt"] is None and "url" not in entry
    img = png(base64.b64decode(entry["b64_json"]))
    assert img.format == "PNG" and img.size == (SIZE, SIZE) and img.mode == "RGB"
    assert body["job_id"].startswith("j_")


async def test_images_generations_response_format_url_serves_the_output(sock: Path) -> None:
    async with http(sock) as s:
        status, body, _ = await post(
            s, "/v1/images/generations", {**IMAGES, "prompt": "a fox", "n": 2, "response_format": "url"}
        )
        assert status == 200, body
        assert [e.keys() >= {"url", "seed"} and "b64_json" not in e for e in body["data"]] == [True, True]
        for k, entry in enumerate(body["data"]):
            assert entry["url"] == f"/v1/jobs/{body['job_id']}/outputs/{k}"
            data, ctype = await fetch(s, entry["url"])
            assert ctype == "image/png"
            assert png(data).size == (SIZE, SIZE)


async def test_openai_python_client_over_the_socket(sock: Path) -> None:
    import httpx
    import openai

    def call() -> Any:
        transport = httpx.HTTPTransport(uds=str(sock))
        with httpx.Client(transport=transport, timeout=60) as hc:
            client = openai.OpenAI(base_url="http://diffusiond/v1", api_key="unused", http_client=hc)
            return client.images.generate(
                model="tiny",
                prompt="a lighthouse at dusk",
                size="64x64",
                n=1,
                response_format="b64_json",
                extra_body={"num_inference_steps": STEPS, "seed": 1},
            )

    result = await asyncio.to_thread(call)
    assert result.data is not None and len(result.data) == 1
    assert result.data[0].b64_json is not None
    from_openai = base64.b64decode(result.data[0].b64_json)
    assert png(from_openai).size == (SIZE, SIZE)
    async with http(sock) as s:  # the same request by hand gives the same image
        status, body, _ = await post(
            s, "/v1/images/generations", {**IMAGES, "prompt": "a lighthouse at dusk", "seed": 1}
        )
    assert status == 200, body
    assert base64.b64decode(body["data"][0]["b64_json"]) == from_openai


# jobs and events ------------------------------------------------------------------------------
async def test_job_events_progress_then_done_and_a_late_subscriber_gets_the_end_at_once(sock: Path) -> None:
    async with http(sock) as s:
        status, job, _ = await post(
            s, "/v1/jobs", {"model": "slow", "prompt": "x", "width": SIZE, "height": SIZE, "steps": 4, "seed": 5}
        )
        assert status == 202 and job["status"] in ("queued", "running"), job
        events = await asyncio.wait_for(sse(s, job["id"]), 60)
        names = [name for name, _ in events]
        assert names[0] == "status"  # the current state first
        assert names[-1] == "done" and names.count("done") == 1 and "error" not in names
        progress = [data for name, data in events if name == "progress"]
        assert progress, names
        steps = [p["step"] for p in progress]
        assert steps == sorted(steps) and steps[-1] == 4 and all(p["total"] == 4 for p in progress)
        done = events[-1][1]
        assert done["id"] == job["id"] and done["status"] == "succeeded" and done["stage"] == "done"
        assert [o["seed"] for o in done["outputs"]] == [5]
        assert done["progress"] == {"step": 4, "total": 4}
        assert set(done["timings_ms"]) >= {"queued", "compute", "copy", "encode", "total"}

        late = await asyncio.wait_for(sse(s, job["id"]), 10)
    assert [name for name, _ in late] == ["status", "done"]
    assert all(data["status"] == "succeeded" for _, data in late)


async def test_get_job_shape(sock: Path) -> None:
    async with http(sock) as s:
        job = await run_job(s, {**FAST, "prompt": "a fox", "seed": 9})
        status, again = await get_json(s, f"/v1/jobs/{job['id']}")
        assert status == 200 and again["id"] == job["id"]
        status, listing = await get_json(s, "/v1/jobs")
    assert status == 200 and job["id"] in [j["id"] for j in listing["data"]]
    assert job["status"] == "succeeded" and job["stage"] == "done" and job["error"] is None
    (out,) = job["outputs"]
    assert out == {
        "index": 0,
        "url": f"/v1/jobs/{job['id']}/outputs/0",
        "content_type": "image/png",
        "seed": 9,
        "bytes": out["bytes"],
        "batch": out["batch"],
        "trajectory": None,  # a job that asked for none (docs/api.md, "Trajectories")
        "audio": None,  # a model that makes no sound (docs/api.md, "Sound tracks")
        "lora_versions": None,  # no adapter, no component updated (docs/api.md, "Versions")
        "weight_versions": None,
    }
    assert out["bytes"] > 0 and isinstance(out["batch"], int)


# output formats -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fmt", "ctype", "pil_format"),
    [("png", "image/png", "PNG"), ("jpeg", "image/jpeg", "JPEG"), ("webp", "image/webp", "WEBP")],
)
async def test_image_formats_decode(sock: Path, fmt: str, ctype: str, pil_format: str) -> None:
    async with http(sock) as s:
        job = await run_job(s, {**FAST, "prompt": "a fox", "output_format": fmt, "n": 2})
        assert job["status"] == "succeeded", job
        assert [o["content_type"] for o in job["outputs"]] == [ctype, ctype]
        for o in job["outputs"]:
            data, served = await fetch(s, o["url"])
            assert served == ctype and len(data) == o["bytes"]
            img = png(data)
            assert img.format == pil_format and img.size == (SIZE, SIZE)


async def test_npy_uint8_and_float32(sock: Path) -> None:
    async with http(sock) as s:
        u8, f32 = await asyncio.gather(
            run_job(s, {**FAST, "prompt": "a fox", "output_format": "npy", "seed": 4}),
            run_job(s, {**FAST, "prompt": "a fox", "output_format": "npy", "output_dtype": "float32", "seed": 4}),
        )
        arrays = {}
        for name, job in (("u8", u8), ("f32", f32)):
            assert job["status"] == "succeeded", job
            data, ctype = await fetch(s, job["outputs"][0]["url"])
            assert ctype == "application/x-npy" and len(data) == job["outputs"][0]["bytes"]
            arrays[name] = np.load(io.BytesIO(data), allow_pickle=False)
    a, f = arrays["u8"], arrays["f32"]
    assert a.shape == (SIZE, SIZE, 3) and a.dtype == np.uint8
    assert f.shape == (SIZE, SIZE, 3) and f.dtype == np.float32
    assert float(f.min()) >= 0.0 and float(f.max()) <= 1.0 and float(f.max()) > float(f.min())
    # the same seed: the uint8 output is the float one, quantized
    assert int(np.abs(np.round(f * 255).astype(np.int16) - a.astype(np.int16)).max()) <= 1


async def test_video_mp4_has_the_asked_frames(sock: Path) -> None:
    import av

    async with http(sock) as s:
        job = await run_job(
            s,
            {"model": "video", "prompt": "waves", "width": SIZE, "height": SIZE, "steps": 2, "num_frames": 3, "fps": 8},
        )
        assert job["status"] == "succeeded", job
        data, ctype = await fetch(s, job["outputs"][0]["url"])
    assert ctype == "video/mp4"
    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 3 and frames[0].shape == (SIZE, SIZE, 3)


async def test_png_text_chunks_carry_prompt_and_seed(sock: Path) -> None:
    prompt = "a red fox in the snow, photo"
    async with http(sock) as s:
        job = await run_job(s, {**FAST, "prompt": prompt, "seed": 1234, "n": 2})
        texts = [png((await fetch(s, o["url"]))[0]).text for o in job["outputs"]]  # type: ignore[attr-defined]
    assert [t["prompt"] for t in texts] == [prompt, prompt]
    assert [t["seed"] for t in texts] == ["1234", "1235"]


# concurrency and determinism ------------------------------------------------------------------
async def test_32_concurrent_requests_all_succeed(sock: Path) -> None:
    async def one(s: aiohttp.ClientSession, i: int) -> tuple[str, int, list[int]]:
        n = 1 + i % 3
        if i % 2:
            status, body, _ = await post(
                s, "/v1/images/generations", {**IMAGES, "prompt": f"fox {i}", "n": n, "seed": 1000 * i}
            )
            assert status == 200, body
            for entry in body["data"]:
                assert png(base64.b64decode(entry["b64_json"])).size == (SIZE, SIZE)
            return body["job_id"], n, [e["seed"] for e in body["data"]]
        job = await run_job(s, {**FAST, "prompt": f"fox {i}", "n": n, "seed": 1000 * i})
        assert job["status"] == "succeeded", job
        for o in job["outputs"]:
            assert png((await fetch(s, o["url"]))[0]).size == (SIZE, SIZE)
        return job["id"], n, [o["seed"] for o in job["outputs"]]

    async with http(sock) as s:
        results = await asyncio.wait_for(asyncio.gather(*(one(s, i) for i in range(32))), 240)
    assert len({job_id for job_id, _, _ in results}) == 32
    for i, (_, n, seeds) in enumerate(results):
        assert seeds == [1000 * i + k for k in range(n)]


async def test_same_seed_same_bytes_and_n2_gives_seeds_s_and_s_plus_1(sock: Path) -> None:
    async def gen(s: aiohttp.ClientSession, seed: int, n: int = 1) -> list[tuple[int, bytes]]:
        status, body, _ = await post(
            s, "/v1/images/generations", {**IMAGES, "prompt": "a lighthouse", "seed": seed, "n": n}
        )
        assert status == 200, body
        return [(e["seed"], base64.b64decode(e["b64_json"])) for e in body["data"]]

    async with http(sock) as s:
        (first,) = await gen(s, 77)
        (second,) = await gen(s, 77)
        (other,) = await gen(s, 78)
        pair = await gen(s, 77, n=2)
    assert first[0] == second[0] == 77
    assert first[1] == second[1]
    assert other[1] != first[1]
    assert [seed for seed, _ in pair] == [77, 78]
    assert same_image(pair[0][1], first[1]) and same_image(pair[1][1], other[1])


# bad input ------------------------------------------------------------------------------------
BAD = [
    # (endpoint, body, status, field)
    ("/v1/jobs", {"prompt": "a" * 10_001}, 400, "prompt"),
    ("/v1/jobs", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/jobs", {"prompt": "x", "n": 17}, 400, "n"),
    ("/v1/jobs", {"prompt": "x", "n": "two"}, 400, "n"),
    ("/v1/jobs", {"prompt": "x", "width": 63}, 400, "width"),
    ("/v1/jobs", {"prompt": "x", "height": 60}, 400, "height"),
    ("/v1/jobs", {"prompt": "x", "width": 4104}, 400, "width"),
    ("/v1/jobs", {"prompt": "x", "width": 0}, 400, "width"),
    ("/v1/jobs", {"prompt": "x", "steps": 0}, 400, "steps"),
    ("/v1/jobs", {"prompt": "x", "steps": 501}, 400, "steps"),
    ("/v1/jobs", {"prompt": "x", "num_frames": 8}, 400, "num_frames"),
    ("/v1/jobs", {"prompt": "x", "colour": "red"}, 400, "colour"),
    ("/v1/jobs", {"n": 1}, 400, "prompt"),
    ("/v1/jobs", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ("/v1/jobs", {"prompt": "x", "model": "video", "num_frames": 0}, 400, "num_frames"),
    ("/v1/jobs", {"prompt": "x", "model": "video", "num_frames": 1025}, 400, "num_frames"),
    ("/v1/jobs", {"prompt": "x", "model": "video", "fps": 0}, 400, "fps"),
    ("/v1/jobs", {"prompt": "x", "model": "video", "output_format": "png"}, 400, "output_format"),
    ("/v1/jobs", {"prompt": "x", "output_format": "mp4"}, 400, "output_format"),
    ("/v1/jobs", {"prompt": "x", "output_dtype": "float32"}, 400, "output_dtype"),
    ("/v1/images/generations", {"prompt": "x", "size": "63x64"}, 400, "size"),
    ("/v1/images/generations", {"prompt": "x", "size": "big"}, 400, "size"),
    ("/v1/images/generations", {"prompt": "x", "num_inference_steps": 0}, 400, "num_inference_steps"),
    ("/v1/images/generations", {"prompt": "x", "num_inference_steps": 501}, 400, "num_inference_steps"),
    ("/v1/images/generations", {"prompt": "x", "n": 17}, 400, "n"),
    ("/v1/images/generations", {"prompt": "x", "response_format": "gif"}, 400, "response_format"),
    ("/v1/images/generations", {"prompt": "x", "colour": "red"}, 400, "colour"),
    ("/v1/images/generations", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
]


async def test_bad_inputs_are_4xx_json_naming_the_field(sock: Path) -> None:
    async with http(sock) as s:
        _, before = await get_json(s, "/health")
        for path, body, want_status, field in BAD:
            status, answer, _ = await post(s, path, {**IMAGES, **body} if "images" in path else body)
            assert status == want_status, (path, body, answer)
            assert set(answer) == {"error"}, answer
            err = answer["error"]
            assert err["field"] == field, (path, body, err)
            assert err["code"] and err["message"], err
        # nothing was admitted
        _, after = await get_json(s, "/health")
    assert after["jobs"] == before["jobs"]


async def test_limits_edges_are_accepted(sock: Path) -> None:
    async with http(sock) as s:
        jobs = await asyncio.gather(
            run_job(s, {**FAST, "prompt": "x", "width": 72}),
            run_job(s, {**FAST, "prompt": "x" * 10_000, "steps": 1, "n": 1}),
        )
        for job in jobs:
            assert job["status"] == "succeeded", job
        data, _ = await fetch(s, jobs[0]["outputs"][0]["url"])
    assert png(data).size == (72, SIZE)


async def test_invalid_json_and_oversized_body(sock: Path) -> None:
    async with http(sock) as s:
        status, answer, _ = await post(s, "/v1/jobs", b'{"prompt": "x",')
        assert status == 400 and answer["error"]["code"] == "invalid_json", answer
        status, answer, _ = await post(s, "/v1/jobs", b"")
        assert status == 400 and answer["error"]["code"] == "invalid_json", answer
        big = b'{"prompt": "' + b"a" * (1 << 20) + b'"}'
        status, answer, _ = await post(s, "/v1/jobs", big)
        assert status == 413 and answer["error"]["code"] == "request_too_large", answer
        status, answer, _ = await post(s, "/v1/images/generations", big)
        assert status == 413 and answer["error"]["code"] == "request_too_large", answer


async def test_unknown_job_and_delete_of_a_finished_job(sock: Path) -> None:
    async with http(sock) as s:
        status, answer = await get_json(s, "/v1/jobs/j_0000000000000000")
        assert status == 404 and answer["error"]["code"] == "job_not_found", answer
        async with s.delete("/v1/jobs/j_0000000000000000") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "job_not_found"
        async with s.get("/v1/jobs/j_0000000000000000/events") as r:
            assert r.status == 404
        job = await run_job(s, {**FAST, "prompt": "x"})
        assert job["status"] == "succeeded"
        async with s.delete(f"/v1/jobs/{job['id']}?finished=keep") as r:  # a cancel that came too late
            assert r.status == 409
            err = (await r.json())["error"]
        assert err["code"] == "job_finished" and "succeeded" in err["message"]
        status, answer = await get_json(s, f"/v1/jobs/{job['id']}/outputs/1")
        assert status == 404 and answer["error"]["code"] == "output_not_found"
        status, again = await get_json(s, f"/v1/jobs/{job['id']}")
        assert status == 200 and again["status"] == "succeeded"
        async with s.delete(f"/v1/jobs/{job['id']}") as r:  # a plain DELETE of a finished job deletes it
            assert r.status == 200
            deleted = await r.json()
        assert deleted["deleted"] is True and deleted["status"] == "succeeded"
        status, answer = await get_json(s, f"/v1/jobs/{job['id']}")
    assert status == 404 and answer["error"]["code"] == "job_not_found"


async def test_trace_without_trace_flag_says_how_to_turn_it_on(sock: Path) -> None:
    async with http(sock) as s:
        status, answer = await get_json(s, "/v1/admin/trace")
    assert status == 409 and answer["error"]["code"] == "trace_off", answer
    assert "--trace" in answer["error"]["message"]


# service endpoints ----------------------------------------------------------------------------
async def test_health_ready_models(sock: Path, api_daemon: Daemon) -> None:
    async with http(sock) as s:
        status, health = await get_json(s, "/health")
        assert status == 200, health
        status, ready = await get_json(s, "/ready")
        assert status == 200 and ready == {"ready": True, "preload": {"state": "done", "models": []}}
        status, models = await get_json(s, "/v1/models")
    assert status == 200
    assert health["status"] == "ok" and health["accepting"] is True and health["sleeping"] is False
    workers = health["workers"]
    assert sorted(w["model"] for w in workers) == ["slow", "tiny", "tiny", "video"]
    assert all(w["state"] == "ready" and w["device"] == "cpu" and w["restarts"] == 0 for w in workers)
    assert sorted(w["pid"] for w in workers) == sorted(api_daemon.worker_pids())
    by_id = {m["id"]: m for m in models["data"]}
    assert set(by_id) == {"tiny", "slow", "video"}
    for m in by_id.values():
        assert set(m["device"].split(",")) == {"cpu"} and m["state"] == "ready"
    assert [by_id[m]["task"] for m in ("tiny", "slow", "video")] == ["text-to-image"] * 2 + ["text-to-video"]


async def test_metrics_prometheus_text(sock: Path) -> None:
    async with http(sock) as s:
        job = await run_job(s, {**FAST, "prompt": "x"})
        assert job["status"] == "succeeded"
        async with s.get("/metrics") as r:
            assert r.status == 200 and r.content_type == "text/plain"
            text = await r.text()
    samples = {line.split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name in (
        "diffusiond_queue_depth",
        "diffusiond_jobs_total",
        "diffusiond_batch_size",
        "diffusiond_stage_seconds",
        "diffusiond_arena_bytes_in_use",
        "diffusiond_worker_restarts_total",
    ):
        assert f"# TYPE {name.removesuffix('_total')}" in text or f"# TYPE {name}" in text, name
    assert "diffusiond_queue_depth" in samples
    assert 'diffusiond_jobs_total{status="succeeded"}' in samples
    assert "diffusiond_batch_size_count" in samples
    for stage in ("queued", "compute", "copy", "encode"):
        assert f'diffusiond_stage_seconds_count{{stage="{stage}"}}' in samples, stage
    assert {'diffusiond_arena_bytes_in_use{worker="0"}', 'diffusiond_arena_bytes_in_use{worker="2"}'} <= samples
    # zero restarts is a value, not a missing series
    assert 'diffusiond_worker_restarts_total{model="tiny"}' in samples
    assert 'diffusiond_worker_restarts_total{model="slow"}' in samples


def test_socket_is_owner_only(sock: Path) -> None:
    st = os.stat(sock)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.getuid()
