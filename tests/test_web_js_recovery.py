"""The page when the daemon goes away under it (tests/webjs_harness.js, the page's scripts in Node): a job
whose event stream is refused, a daemon that does not answer yet when the page loads, a sign-out while
the models panel polls. The harness runs the page's timers only when a step ticks, so waits of seconds
take none here.
"""

from __future__ import annotations

from typing import Any

from test_web_js import SERVED, page

REFUSED_THEN_FOLLOWED: list[dict[str, Any]] = [{"refuse_stream": True}, {"tick": 1}]
SEND = {"values": {"prompt": "a cat"}, "submit": True}
RUNNING = {"id": "j_1", "status": "running", "stage": "denoising", "model": "tiny"}


def one_shots(step: dict[str, Any]) -> list[int]:
    return [t["ms"] for t in step["timers"] if not t["every"]]


def test_a_running_job_whose_stream_is_refused_is_followed_again_until_it_ends() -> None:
    done = {"id": "j_1", "status": "succeeded", "outputs": [], "model": "tiny"}
    steps = page([SEND,
                  {"serve": {"/v1/jobs/j_1": RUNNING}, "refuse_stream": True},
                  {"tick": 1},
                  *REFUSED_THEN_FOLLOWED * 5,
                  {"refuse_stream": True},
                  {"serve": {"/v1/jobs/j_1": done}, "tick": 1},
                  {"refuse_stream": True}])["steps"]
    refused, again = steps[1], steps[2]
    assert refused["generate_disabled"] and refused["status"].startswith("running (denoising)"), refused
    assert "following again in 1 s" in refused["status"] and one_shots(refused) == [1000]
    assert (again["opened"], again["streams"]) == (2, 1)  # a new EventSource on the same job
    # each refusal waits twice as long, up to 15 s
    assert [one_shots(s)[0] for s in steps[3:14:2]] == [2000, 4000, 8000, 15000, 15000, 15000]
    end = steps[-1]
    assert end["status_code"] == "succeeded" and not end["generate_disabled"], end
    assert (end["streams"], one_shots(end)) == (0, [])


def test_a_refused_stream_whose_job_cannot_be_asked_for_says_the_status_is_unknown() -> None:
    """Not the status it had when sent ("queued") as if it were the end; Generate works again."""
    steps = page([SEND, {"fail": {"/v1/jobs/j_1": [502]}, "refuse_stream": True}])["steps"]
    sent, lost = steps
    assert sent["generate_disabled"] and sent["status"] == "queued"
    assert (lost["status"], lost["status_code"]) == ("status unknown", "unknown"), lost
    assert "lost job j_1" in lost["error"] and "refused with 502" in lost["error"] and "↻" in lost["error"]
    assert not lost["generate_disabled"] and (lost["streams"], one_shots(lost)) == (0, [])


def test_the_models_are_asked_for_again_until_the_daemon_answers() -> None:
    answers = {**SERVED, "fail": {"/v1/models": [503, 0]}}  # restarting, then not even listening
    steps = page([{}, {"tick": 1}, {"tick": 1}], answers, ready=False)["steps"]
    first, second, back = steps
    assert not first["ready"] and "refused with 503" in first["error"] and "trying again in 1 s" in first["error"]
    assert not second["ready"] and "did not answer" in second["error"] and "trying again in 2 s" in second["error"]
    assert back["ready"] and back["error"] == "" and [r[0] for r in back["residency"]] == ["tiny", "hold", "clip",
                                                                                           "inpaint"]
    assert [t["every"] for t in back["timers"]] == [True]  # and the panel's poll runs


def test_a_sign_out_stops_the_models_panels_poll() -> None:
    """A daemon restarted with a new random token answers 401 to every poll until the user signs in again."""
    steps = page([{"tick": 1}, {"fail": {"/v1/models": [401]}, "tick": 1}, {"tick": 3}])["steps"]
    polled, refused, later = steps
    assert polled["fetched"]["/v1/models"] == 2 and not polled["signed_out"]
    assert refused["signed_out"] and refused["timers"] == [], refused["timers"]
    assert later["fetched"]["/v1/models"] == refused["fetched"]["/v1/models"] == 3
