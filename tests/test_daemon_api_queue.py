"""The queue-full answer of docs/api.md (429 ``queue_full`` with ``Retry-After``, counted in
/metrics, room again once a queued job is cancelled), against a daemon of its own with a one-job
queue; and which errors tell OpenAI's SDKs to send again (``x-should-retry``: a queue full may, a
synchronous job past its deadline may not, or it runs twice more for nothing). The rest of the HTTP
API is test_daemon_api.py's, on a daemon the module shares.
"""

from __future__ import annotations

from typing import Any

from apikit import SIZE, get_json, post
from daemonkit import http


async def test_queue_full_is_429_with_retry_after(daemon_factory: Any) -> None:
    d = daemon_factory("--queue-size", "1", "--model", "synthetic:compute_ms=3000", "--job-timeout", "120")
    body = {"prompt": "x", "width": SIZE, "height": SIZE, "steps": 8}
    accepted: list[str] = []
    async with http(d.socket) as s:
        try:
            rejected = None
            for _ in range(8):
                status, answer, headers = await post(s, "/v1/jobs", body)
                if status == 202:
                    accepted.append(answer["id"])
                    continue
                rejected = (status, answer, headers)
                break
            assert rejected is not None, "a one-job queue never filled"
            status, answer, headers = rejected
            assert status == 429 and answer["error"]["code"] == "queue_full", answer
            assert float(headers["Retry-After"]) > 0 and headers["x-should-retry"] == "true"
            assert accepted
            _, health = await get_json(s, "/health")
            assert health["queue_depth"] == 1
            metrics = await (await s.get("/metrics")).text()
            assert 'diffusiond_rejected_total{reason="queue_full"} 1.0' in metrics
            # room again once the queued job is cancelled
            async with s.delete(f"/v1/jobs/{accepted[-1]}") as r:
                assert r.status == 200
            status, answer, _ = await post(s, "/v1/jobs", body)
            assert status == 202, answer
            accepted.append(answer["id"])
        finally:
            for job_id in accepted:
                async with s.delete(f"/v1/jobs/{job_id}"):
                    pass
        # a synchronous job past its deadline: 504, and an SDK that retries 5xx is told not to. It waits in the queue
        # of a daemon put to sleep, so the deadline passes whatever the box's speed (the synthetic model calibrates
        # its work at load: on a box busy then, a "3000 ms" batch ran in under 0.1 s and beat the deadline)
        async with s.post("/v1/admin/sleep") as r:
            assert r.status == 200, await r.text()
        status, answer, headers = await post(s, "/v1/images/generations",
                                             {"prompt": "x", "size": f"{SIZE}x{SIZE}", "timeout_s": 0.5})
        assert status == 504 and answer["error"]["code"] == "deadline_exceeded", answer
        assert headers["x-should-retry"] == "false"
