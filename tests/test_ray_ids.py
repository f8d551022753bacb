"""The Ray Serve adapter's pure parts, without a cluster: which replica a request must reach,
job ids bound to their replica in what the daemon answers, and the builder's arguments (what
``serve run diffusiond.ray:build ...`` users type)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from diffusiond.ray import ids
from diffusiond.ray.app import Options


def test_a_jobs_routes_reach_the_replica_its_id_names_with_the_daemons_own_id() -> None:
    assert ids.route("GET", "/v1/jobs/k3x9q2ab.j_0123456789abcdef") == ("k3x9q2ab", "/v1/jobs/j_0123456789abcdef")
    assert ids.route("DELETE", "/v1/jobs/k3x9q2ab.j_0123456789abcdef") == ("k3x9q2ab", "/v1/jobs/j_0123456789abcdef")
    assert ids.route("GET", "/v1/jobs/k3x9q2ab.j_0a/events") == ("k3x9q2ab", "/v1/jobs/j_0a/events")
    assert ids.route("GET", "/v1/jobs/k3x9q2ab.j_0a/outputs/1") == ("k3x9q2ab", "/v1/jobs/j_0a/outputs/1")
    assert ids.route("GET", "/v1/jobs/k3x9q2ab.j_0a/outputs/1/trajectory/latents") == (
        "k3x9q2ab", "/v1/jobs/j_0a/outputs/1/trajectory/latents")
    assert ids.route("GET", "/v1/jobs/k3x9q2ab.j_0a/outputs/1/audio") == ("k3x9q2ab", "/v1/jobs/j_0a/outputs/1/audio")
    assert ids.route("GET", "/v1/jobs/k3x9q2ab.j_0a/preview/0") == ("k3x9q2ab", "/v1/jobs/j_0a/preview/0")
    assert ids.route("GET", "/v1/loras") == (None, "/v1/loras")
    assert ids.route("GET", "/v1/ip-adapters") == (None, "/v1/ip-adapters")
    assert ids.route("GET", "/v1/upscalers") == (None, "/v1/upscalers")
    assert ids.route("POST", "/v1/jobs") == (None, "/v1/jobs")
    assert ids.route("POST", "/v1/images/generations") == (None, "/v1/images/generations")


@pytest.mark.parametrize(("method", "path", "status", "says"), [
    ("GET", "/v1/jobs/j_0123456789abcdef", 404, "REPLICA.j_HEX"),  # a daemon's bare id: which replica?
    ("GET", "/v1/jobs/k3x9q2ab.nope", 404, "REPLICA.j_HEX"),
    ("POST", "/v1/jobs/k3x9q2ab.j_0a/events", 405, "allowed are GET"),
    ("DELETE", "/v1/jobs", 405, "allowed are GET, POST"),
    ("POST", "/v1/admin/sleep", 404, "use its socket"),
    # not an admin route, and said so
    ("POST", "/v1/models/tiny/load", 404, "not forwarded through Ray Serve: it moves a model in one daemon"),
    ("POST", "/v1/models/tiny/unload", 404, "the router decides where models load"),
])
def test_requests_no_daemon_can_answer_get_an_error_that_says_why(method: str, path: str, status: int,
                                                                   says: str) -> None:
    with pytest.raises(ids.RouteError) as err:
        ids.route(method, path)
    assert err.value.status == status and says in str(err.value)


def test_job_ids_and_urls_are_bound_to_the_replica_and_the_prompt_is_left_as_sent() -> None:
    job = {"id": "j_0a", "object": "job", "outputs": [{"index": 0, "url": "/v1/jobs/j_0a/outputs/0"}],
           "request": {"prompt": "j_0a", "n": 1}, "error": None}
    assert ids.bind_document(job, "r1") == {
        "id": "r1.j_0a", "object": "job", "outputs": [{"index": 0, "url": "/v1/jobs/r1.j_0a/outputs/0"}],
        "request": {"prompt": "j_0a", "n": 1}, "error": None}
    listing = {"object": "list", "data": [{"id": "j_0b"}, {"id": "tiny"}]}
    assert ids.bind_document(listing, "r1")["data"] == [{"id": "r1.j_0b"}, {"id": "tiny"}]
    assert ids.bind_document({"created": 1, "data": [], "job_id": "j_0c"}, "r1")["job_id"] == "r1.j_0c"
    assert ids.bind_header('inline; filename="j_0c-0.png"', "r1") == 'inline; filename="r1.j_0c-0.png"'


def test_a_job_lists_next_page_goes_to_the_replica_that_listed_it_with_the_daemons_own_cursor() -> None:
    """``next_before`` was left bare, so the next page went to any replica by load."""
    page = {"object": "list", "data": [{"id": "j_00ab"}], "has_more": True, "next_before": "j_00ab"}
    bound = ids.bind_document(page, "k3x9q2ab")
    assert bound["next_before"] == "k3x9q2ab.j_00ab"
    assert ids.route_query("GET", "/v1/jobs", f"limit=5&before={bound['next_before']}") == (
        "k3x9q2ab", "limit=5&before=j_00ab")
    assert ids.route_query("GET", "/v1/jobs", "limit=5") == (None, "limit=5")  # the first page: any replica
    assert ids.route_query("GET", "/v1/jobs", "before=") == (None, "before=")  # the daemon reads it as none
    with pytest.raises(ids.RouteError) as err:
        ids.route_query("GET", "/v1/jobs", "before=j_00ab")  # a daemon's bare id: which replica's list?
    assert err.value.status == 400 and err.value.field == "before" and "REPLICA.j_HEX" in str(err.value)


def test_the_builder_reads_serve_run_strings_and_deploy_yaml_values_alike() -> None:
    cli = Options.parse({"model": "sd=/models/sd15", "replicas": "2", "gpus_per_replica": "1"})
    yaml = Options.parse({"model": ["sd=/models/sd15"], "replicas": 2, "gpus_per_replica": 1})
    assert cli == yaml
    assert cli.serve_args() == ["--model", "sd=/models/sd15", "--device", "cuda"]
    auto = Options.parse({"model": "a=tiny,b=tiny", "replicas": "auto", "min_replicas": "0",
                          "daemon_args": "--max-batch 8 --job-timeout 60"})
    assert auto.replicas is None and auto.min_replicas == 0
    assert auto.serve_args() == ["--model", "a=tiny", "--model", "b=tiny", "--device", "cpu",
                                 "--max-batch", "8", "--job-timeout", "60"]


@pytest.mark.parametrize(("args", "says"), [
    ({"replica": "2"}, "unknown argument(s) replica"),
    ({"replicas": "two"}, "replicas='two': expected an integer"),
    ({"replicas": "0"}, "replicas='0': expected a value >= 1"),
    ({"gpus_per_replica": "-1"}, "gpus_per_replica='-1': expected a value >= 0"),
    ({"model": ""}, "model='': expected at least one model spec"),
    ({"replicas": "auto", "min_replicas": "3", "max_replicas": "2"}, "min_replicas=3 and max_replicas=2"),
])
def test_a_wrong_builder_argument_is_named_with_what_it_accepts(args: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError) as err:
        Options.parse(args)
    assert says in str(err.value)


def test_autoscaling_asks_for_replicas_by_the_daemons_own_queue() -> None:
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'diffusiond[ray]')")
    from ray.serve.config import AutoscalingConfig

    from diffusiond.ray.router import queue_policy

    config = AutoscalingConfig(min_replicas=0, max_replicas=8, target_ongoing_requests=4)

    def ctx(loads: dict[str, float]) -> object:
        return types.SimpleNamespace(aggregated_metrics={"daemon_load": loads}, target_num_replicas=2, config=config)

    assert queue_policy(ctx({"a": 9, "b": 8}))[0] == 5  # 17 jobs queued or running, 4 per replica
    assert queue_policy(ctx({"a": 0, "b": 0}))[0] == 0  # idle: down to min_replicas (Serve clamps)
    assert queue_policy(ctx({}))[0] == 2  # no figures yet: stay where we are


def test_each_replicas_daemon_keeps_its_jobs_in_a_state_dir_of_its_own(tmp_path: Path) -> None:
    """A state dir holds one daemon (a lock): two replicas on one node must not share one, or the
    second's daemon refuses to start."""
    from diffusiond.ray.replica import own_state_dir

    private = tmp_path / "replica-a"
    assert own_state_dir(["--model", "tiny"], private, "a")[-3:] == ["--no-persist", "--state-dir",
                                                                      str(private / "state")]
    shared = own_state_dir(["--state-dir", "/mnt/shared", "--model", "tiny"], private, "a")
    assert shared[:2] == ["--state-dir", "/mnt/shared/a"]
    assert own_state_dir(["--no-persist"], private, "a") == ["--no-persist"]


def test_a_gateway_bound_beyond_loopback_without_a_token_is_refused_naming_the_argument(tmp_path: Path) -> None:
    from diffusiond.ray.app import check_access

    with pytest.raises(ValueError, match="token_file=FILE or token_env=VAR") as err:
        check_access(Options.parse({}), "0.0.0.0")
    assert "allow_unauthenticated=true" in str(err.value)
    check_access(Options.parse({}), "127.0.0.1")  # loopback: the machine's own users, as the socket
    check_access(Options.parse({"allow_unauthenticated": "true"}), "0.0.0.0")  # said explicitly
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-32-characters-xx\n")
    check_access(Options.parse({"token_file": str(token)}), "0.0.0.0")
    token.write_text("short")
    with pytest.raises(ValueError, match="shorter than 16"):
        check_access(Options.parse({"token_file": str(token)}), "0.0.0.0")
    with pytest.raises(ValueError, match="token_file='/nope/token': cannot read it"):
        check_access(Options.parse({"token_file": "/nope/token"}), "127.0.0.1")
    with pytest.raises(ValueError, match="token_env='DIFFUSIOND_NO_SUCH_VAR': the environment variable is unset"):
        check_access(Options.parse({"token_env": "DIFFUSIOND_NO_SUCH_VAR"}), "0.0.0.0")
    with pytest.raises(ValueError, match="allow_unauthenticated='maybe': expected true or false"):
        Options.parse({"allow_unauthenticated": "maybe"})


def test_the_router_prefers_the_model_on_the_device_then_in_host_memory_and_trusts_no_stale_report() -> None:
    from diffusiond.ray.router import View, by_residency

    def pick(model: str | None, **views: View) -> list[str]:
        return sorted(by_residency(model, views, stale_after_s=6.0, model_affinity=8))

    on_a = View({"sd": "device", "xl": "disk"}, 1.0, 3)
    on_b = View({"sd": "disk", "xl": "device"}, 1.0, 0)
    assert pick("sd", a=on_a, b=on_b) == ["a"]  # on the device beats a lighter load elsewhere
    assert pick("xl", a=on_a, b=on_b) == ["b"]
    assert pick("sd", a=on_a, b=View({"sd": "loading"}, 1.0, 0)) == ["a", "b"]  # loading is as good: it will be there
    assert pick("sd", a=View({"sd": "host"}, 1.0, 0), b=View({"sd": "disk"}, 1.0, 0)) == ["a"]
    assert pick("sd", a=View({"sd": "host"}, 1.0, 0), b=on_a) == ["b"]
    # a report first seen 10 s ago (the replica stopped reporting): its residency is not trusted
    assert pick("sd", a=View({"sd": "device"}, 10.0, 0), b=View({"sd": "host"}, 1.0, 0)) == ["b"]
    assert pick("sd", a=View({"sd": "device"}, 10.0, 0), b=View({"sd": "disk"}, 1.0, 0)) == ["a", "b"]
    # a replica that holds the model but whose queue is long shares its work with the others
    assert pick("sd", a=View({"sd": "device"}, 1.0, 8), b=on_b) == ["a", "b"]
    assert pick(None, a=on_a, b=on_b) == ["a", "b"]  # no model named: the daemon's default, by load
    assert pick("unknown", a=on_a, b=on_b) == ["a", "b"]


def test_batch_keys_keep_apart_what_the_daemon_would_not_batch() -> None:
    base = {"prompt": "x", "model": "tiny", "steps": 4}
    assert ids.batch_key(base) == ids.batch_key({**base, "prompt": "another"})  # prompts batch together
    for field, value in (("control", [{"name": "edges", "image": "AAAA", "scale": 0.5}]),
                         ("ip_adapter", [{"name": "style", "image": "AAAA"}]),
                         ("trajectory", {"latents": True}), ("loras", [{"name": "ink"}]), ("eta", 0.5)):
        assert ids.batch_key({**base, field: value}) != ids.batch_key(base), field
    assert ids.batch_key({**base, "audio": False}) == ids.batch_key(base)  # the track is made either way
    # an edit's pictures, one or several (issue 30), batch as the daemon batches them: whatever they are
    assert ids.batch_key({**base, "images": ["a", "b"]}) == ids.batch_key({**base, "images": ["c"]})
    # only LTX-2 is conditioned on fps, which the body does not show: other video models batch across it
    assert ids.batch_key({**base, "fps": 24}) == ids.batch_key({**base, "fps": 8}) == ids.batch_key(base)
    assert ids.batch_key({"not": "a generation"}) is None


def _request(path: str, root_path: str = "", chunks: tuple[bytes, ...] = (),
             headers: tuple[tuple[bytes, bytes], ...] = ()) -> Any:
    from starlette.requests import Request

    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    messages = messages or [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": root_path, "query_string": b"",
             "headers": list(headers)}
    return Request(scope, receive)


def test_routes_are_read_below_the_applications_route_prefix() -> None:
    """Serve keeps the whole path in ``path`` and the prefix in ``root_path``; with a prefix
    other than ``/`` every route read as unknown."""
    from diffusiond.ray.gateway import _own_path

    assert _own_path(_request("/gen/v1/jobs", "/gen")) == "/v1/jobs"
    assert _own_path(_request("/v1/jobs")) == "/v1/jobs"
    assert _own_path(_request("/gen", "/gen")) == "/"


async def test_a_chunked_body_over_the_limit_is_refused_without_being_read_whole(monkeypatch: Any) -> None:
    """Only Content-Length was checked, so a chunked upload was read into memory without bound."""
    import diffusiond.ray.gateway as gateway

    monkeypatch.setattr(gateway, "MAX_BODY_BYTES", 10)
    assert await gateway._body_within_limit(_request("/v1/jobs", chunks=(b"12345", b"67890"))) == b"1234567890"
    assert await gateway._body_within_limit(_request("/v1/jobs", chunks=(b"12345", b"67890", b"!"))) is None
    told = _request("/v1/jobs", chunks=(b"1",), headers=((b"content-length", b"11"),))
    assert await gateway._body_within_limit(told) is None


def test_batch_keys_carry_a_pictures_digest_not_the_picture() -> None:
    """A control's base64 picture went into the key whole (8 MB for an 8 MiB picture), crossed Ray
    beside the body and sat in the router's remembered keys; two different pictures must still stay apart."""
    base = {"prompt": "a", "model": "sd"}
    one, two = "A" * 8_000_000, "A" * 7_999_999 + "B"
    key = ids.batch_key({**base, "control": [{"name": "canny", "image": one, "scale": 1.0}]})
    assert key is not None and len(key) < 1000 and "canny" in key
    assert key != ids.batch_key({**base, "control": [{"name": "canny", "image": two, "scale": 1.0}]})
    assert key == ids.batch_key({**base, "prompt": "b", "control": [{"name": "canny", "image": one, "scale": 1.0}]})
