"""Which replica takes a request: Serve's custom request router, and the autoscaling policy.

Why a request router (Ray Serve's ``RequestRouter``, set in the deployment's
``request_router_config``) and not session affinity or model multiplexing: both of those only
*prefer* a replica and send the request elsewhere when it is busy or unknown, which for a job
would be a 404 from a daemon that never heard of it. The router is handed every running replica
and returns the ones a request may go to, so a request about a job goes to the replica its id
names and to no other (it waits for a free slot there rather than spill). When that replica is
not among the running ones any more it is gone for good (Serve never reuses a replica id): the
request then goes to any replica, which answers 410 naming the replica that held the job.

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
"""

from __future__ import annotations

import math
from typing import Any

from ray.serve.config import AutoscalingContext
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class JobRouter(RequestRouter):
    def initialize_state(self, batch_affinity: int = 4, **kwargs: Any) -> None:
        self.batch_affinity = batch_affinity
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
            bound = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            # gone: any replica answers 410 naming it (it sees that the id is not its own)
            return [bound or candidate_replicas[:1]]
        accepting = [r for r in candidate_replicas if r.routing_stats.get("accepting", True)]
        if not accepting:  # every daemon is asleep or draining: one of them answers 503 with its reason
            return [candidate_replicas]
        if len(self.seen) > 2 * len(candidate_replicas) + 8:  # replicas long gone (seen holds every one loaded)
            live = {r.replica_id.unique_id for r in candidate_replicas}
            self.sent = {k: v for k, v in self.sent.items() if k in live}
            self.seen = {k: v for k, v in self.seen.items() if k in live}
        loads = {r.replica_id.unique_id: self.load(r) for r in accepting}
        key = kwargs.get("batch_key")
        if key is not None:
            preferred = self.last_for_key.get(key)
            for r in accepting:
                if r.replica_id.unique_id == preferred and loads[preferred] < self.batch_affinity:
                    return [[r], accepting]
        least = min(loads.values())
        return [[r for r in accepting if loads[r.replica_id.unique_id] == least], accepting]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        if pending_request.kwargs.get("replica") is not None:
            return  # about a job the replica holds already: no new load
        rid = replica_id.unique_id
        seq = self.seen.get(rid, -1)
        since_seq, sent = self.sent.get(rid, (seq, 0))
        self.sent[rid] = (seq, sent + 1 if since_seq == seq else 1)
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
