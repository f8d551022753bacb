"""Which replica takes a request: Serve's custom request router, and the autoscaling policy.

Why a request router (Ray Serve's ``RequestRouter``, set in the deployment's
``request_router_config``) and not session affinity or model multiplexing: both of those only
*prefer* a replica and send the request elsewhere when it is busy or unknown, which for a job
would be a 404 from a daemon that never heard of it. The router is handed every running replica
and returns the ones a request may go to, so a request about a job goes to the replica its id
names and to no other (it waits for a free slot there rather than spill). When that replica is
not among the running ones any more it is gone for good (Serve never reuses a replica id, and sends a
replica whose stop has begun nothing new): the request then goes to any replica, which answers 410 naming
the replica that held the job, or with a shared state dir serves it from that replica's store.

New work goes by load, and load is the jobs a daemon holds, not Serve's count of calls in flight:
a job submitted through ``POST /v1/jobs`` stops being a call at its 202 and goes on queueing in
the daemon. Each replica reports its daemon's queued plus running jobs every couple of seconds
(``record_routing_stats``, numbered), and the router adds what it sent the replica since the
report it last saw. Serve's count of calls in flight is a floor: it is current for synchronous
requests, but a job stops being a call at its 202. Replicas whose daemon reports sleeping or draining
(``accepting``) are left out; requests that can share a forward pass go to the replica that took
the last such request while its load is under ``batch_affinity``; otherwise the least loaded
replicas come first, and Serve picks among them by its queue-length probing (bounded by
``max_ongoing_requests``).

Before batch affinity and load comes where the job's model is: each report also says, per
model, where its daemon holds it (``device``, ``loading``, ``host``, ``disk``), and new work goes
to the replicas with the model on the device (or loading onto it), else in host memory, while
their load is under ``model_affinity``; so with models loaded on demand each model settles on a
replica instead of every replica loading every model and swapping. A report is only as good as
its age: one the router first saw more than ``stale_after_s`` ago (the replica stopped
reporting) says nothing about residency. What the router sent since a report counts as on the
device there until the report after next, which has seen it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray.serve.config import AutoscalingContext
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

# how good a replica is for a model, by where its daemon holds it (lower first)
RESIDENCY_RANK: Mapping[str, int] = {"device": 0, "loading": 0, "host": 1}
ELSEWHERE = 2


@dataclass(frozen=True)
class View:
    """What the router knows of one replica for new work: its daemon's models by residency, as of
    a report ``age_s`` old, and its load."""

    models: Mapping[str, str]
    age_s: float
    load: int


def residency_rank(view: View, model: str | None, stale_after_s: float) -> int:
    if model is None or view.age_s > stale_after_s:
        return ELSEWHERE
    return RESIDENCY_RANK.get(str(view.models.get(model)), ELSEWHERE)


def by_residency(model: str | None, views: Mapping[str, View], stale_after_s: float, model_affinity: int) -> list[str]:
    """The replicas new work for ``model`` goes among: those that hold it best (on the device,
    then in host memory) with a load under ``model_affinity``; every replica when none holds it."""
    ranks = {rid: residency_rank(v, model, stale_after_s) for rid, v in views.items() if v.load < model_affinity}
    best = min(ranks.values(), default=ELSEWHERE)
    if best == ELSEWHERE:
        return list(views)
    return [rid for rid, rank in ranks.items() if rank == best]


class JobRouter(RequestRouter):
    def initialize_state(self, batch_affinity: int = 4, model_affinity: int = 8, stale_after_s: float = 6.0,
                         **kwargs: Any) -> None:
        self.batch_affinity = batch_affinity
        self.model_affinity = model_affinity
        self.stale_after_s = stale_after_s
        # replica -> (its report's number, when this router first saw it): a report's age
        self.first_seen: dict[str, tuple[int, float]] = {}
        # (replica, model) -> the number of the report current when the router sent it that model's work
        self.placed: dict[tuple[str, str], int] = {}
        self.last_for_key: dict[str, str] = {}
        # replica -> (the number of its last report seen, requests sent to it since that report)
        self.sent: dict[str, tuple[int, int]] = {}
        self.seen: dict[str, int] = {}

    def load(self, replica: RunningReplica) -> int:
        """The jobs ``replica``'s daemon holds, as far as this router can tell."""
        rid = replica.replica_id.unique_id
        stats = replica.routing_stats
        seq = int(stats.get("seq", -1))
        self.seen[rid] = seq
        since_seq, sent = self.sent.get(rid, (seq, 0))
        reported = int(stats.get("load", 0)) + (sent if since_seq == seq else 0)
        # Serve's count of calls in flight there, updated as each is sent: it sees a burst of
        # synchronous requests at once, before their routing is confirmed or any report follows
        in_flight = self.replica_queue_len_cache.get(replica.replica_id) or 0
        return max(reported, in_flight)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("replica")
        if target is not None:
            # the replica whose store it is: its own, or one it adopted from a replica that is gone
            bound = [r for r in candidate_replicas if target in (r.routing_stats.get("stores") or ())]
            bound = bound or [r for r in candidate_replicas if r.replica_id.unique_id == target]
            # gone and adopted by none yet: any replica adopts it now from the shared state dir, or
            # answers 410 naming it (it sees that the id is not its own)
            return [bound or candidate_replicas[:1]]
        accepting = [r for r in candidate_replicas if r.routing_stats.get("accepting", True)]
        if not accepting:  # every daemon is asleep or draining: one of them answers 503 with its reason
            return [candidate_replicas]
        if len(self.seen) > 2 * len(candidate_replicas) + 8:  # replicas long gone (seen holds every one loaded)
            live = {r.replica_id.unique_id for r in candidate_replicas}
            self.sent = {k: v for k, v in self.sent.items() if k in live}
            self.seen = {k: v for k, v in self.seen.items() if k in live}
            self.first_seen = {k: v for k, v in self.first_seen.items() if k in live}
        loads = {r.replica_id.unique_id: self.load(r) for r in accepting}
        model = kwargs.get("model")
        views = {r.replica_id.unique_id: self.view(r, model, loads[r.replica_id.unique_id]) for r in accepting}
        keep = set(by_residency(model, views, self.stale_after_s, self.model_affinity))
        pool = [r for r in accepting if r.replica_id.unique_id in keep]
        key = kwargs.get("batch_key")
        if key is not None:
            preferred = self.last_for_key.get(key)
            for r in pool:
                if r.replica_id.unique_id == preferred and loads[preferred] < self.batch_affinity:
                    return [[r], accepting]
        least = min(loads[r.replica_id.unique_id] for r in pool)
        return [[r for r in pool if loads[r.replica_id.unique_id] == least], accepting]

    def view(self, replica: RunningReplica, model: str | None, load: int) -> View:
        rid = replica.replica_id.unique_id
        stats = replica.routing_stats
        seq = int(stats.get("seq", -1))
        now = time.monotonic()
        if self.first_seen.get(rid, (None, 0.0))[0] != seq:
            self.first_seen[rid] = (seq, now)
        models = dict(stats.get("models") or {})
        if model is not None and (rid, model) in self.placed and seq <= self.placed[(rid, model)] + 1:
            models[model] = "device"  # sent there since a report that could show it
        return View(models, now - self.first_seen[rid][1], load)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        if pending_request.kwargs.get("replica") is not None:
            return  # about a job the replica holds already: no new load
        rid = replica_id.unique_id
        seq = self.seen.get(rid, -1)
        since_seq, sent = self.sent.get(rid, (seq, 0))
        self.sent[rid] = (seq, sent + 1 if since_seq == seq else 1)
        model = pending_request.kwargs.get("model")
        if model is not None:
            if len(self.placed) > 1024:
                self.placed.clear()
            self.placed[(rid, model)] = seq
        key = pending_request.kwargs.get("batch_key")
        if key is not None:
            if len(self.last_for_key) > 1024:
                self.last_for_key.clear()
            self.last_for_key[key] = rid


def queue_policy(ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    """Replicas wanted: the daemons' own load (jobs queued plus running, from
    ``record_autoscaling_stats``) over ``target_ongoing_requests`` per replica. Serve applies
    min/max replicas and the up/down-scale delays around it (with ``min_replicas=0``, an idle
    deployment scales to zero, and Serve's cold start brings one back for the next request)."""
    loads = (ctx.aggregated_metrics or {}).get("daemon_load", {})
    if not loads:
        return ctx.target_num_replicas, {}
    target = ctx.config.get_target_ongoing_requests() if ctx.config is not None else 2.0
    return math.ceil(sum(loads.values()) / max(target, 1e-9)), {}
