"""Which replica takes a request: Serve's custom request router, and the autoscaling policy.

Why a request router (Ray Serve's ``RequestRouter``, set in the deployment's
``request_router_config``) and not session affinity or model multiplexing: both of those only
*prefer* a replica and send the request elsewhere when it is busy or unknown, which for a job
would be a 404 from a daemon that never heard of it. The router is handed every running replica
and returns the ones a request may go to, so a request about a job goes to the replica its id
names and to no other (it waits for a free slot there rather than spill). When that replica is
not among the running ones any more it is gone for good (Serve never reuses a replica id): the
request then goes to any replica, which answers 410 naming the replica that held the job.

New work goes by load: replicas whose daemon reports sleeping or draining (``accepting`` in
``record_routing_stats``) are left out, requests that can share a forward pass go to the replica
that took the last such request while its queue is shorter than ``batch_affinity``, and
otherwise Serve's queue-length probing picks the least loaded of all replicas (bounded by
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
        key = kwargs.get("batch_key")
        if key is not None:
            preferred = self.last_for_key.get(key)
            for r in accepting:
                if r.replica_id.unique_id == preferred:
                    queued = self.replica_queue_len_cache.get(r.replica_id)
                    if queued is not None and queued < self.batch_affinity:
                        return [[r], accepting]
        return [accepting]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        key = pending_request.kwargs.get("batch_key")
        if key is not None:
            if len(self.last_for_key) > 1024:
                self.last_for_key.clear()
            self.last_for_key[key] = replica_id.unique_id


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
