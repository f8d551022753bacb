"""Prometheus metrics. Counters and histograms are updated as things happen; gauges are read from
the engine's state at scrape time, so they can never drift from it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from diffusiond.daemon.residency.decisions import ModelStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _StateCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.snapshot()
        yield GaugeMetricFamily("diffusiond_queue_depth", "Jobs waiting for a worker", value=s["queue_depth"])
        jobs = GaugeMetricFamily(
            "diffusiond_jobs_held", "Jobs held by the daemon (not yet expired), by status", labels=["status"]
        )
        for status, n in s["jobs"].items():
            jobs.add_metric([status], n)
        yield jobs
        arena = GaugeMetricFamily(
            "diffusiond_arena_bytes_in_use", "Shared-memory bytes held by outputs, per worker", labels=["worker"]
        )
        for w in s["workers"]:
            arena.add_metric([str(w["id"])], w["arena_bytes_in_use"])
        yield arena
        yield GaugeMetricFamily("diffusiond_departed_arena_bytes", "Shared-memory arenas of workers gone (stopped "
                                "or lost) still mapped for outputs held; unmapped with the last",
                                value=s["departed_arena_bytes"])
        yield GaugeMetricFamily("diffusiond_output_memory_bytes", "Output bytes held in the engine's own memory: "
                                "encoded outputs (without a state dir) and outputs and trajectories spilled out of "
                                "shared memory", value=s["output_memory_bytes"])
        workers = GaugeMetricFamily("diffusiond_workers", "Workers by state", labels=["model", "state"])
        for w in s["workers"]:
            workers.add_metric([w["model"], w["state"]], 1)
        yield workers


class _ResidencyCollector(Collector):
    """Each model's bytes in each tier, from residency's own books (what ``diffusiond ps`` shows) at
    scrape time. Both tiers for every model, 0 where it is not, so a series does not vanish when a model
    moves and ``sum by (device, tier)`` is each device's use at any instant."""

    def __init__(self, snapshot: Callable[[], Iterable[ModelStatus]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "diffusiond_model_bytes",
            "Bytes a model holds, by tier: device (weights and running work's memory) and host (weights waiting "
            "in host memory)", labels=["model", "device", "tier"])
        for m in self.snapshot():  # a model on several devices: a series per device; host memory on its first
            for device, nbytes in (m.per_device or {m.device: m.device_bytes}).items():
                family.add_metric([m.name, device, "device"], nbytes)
            family.add_metric([m.name, m.device, "host"], m.host_bytes)
        yield family
        kept = GaugeMetricFamily(
            "diffusiond_kept_host_bytes", "Of a model's host bytes, the page-locked copy of its weights its workers "
            "keep while it is on its device, for its next move to host memory (issue 27)", labels=["model"])
        for m in self.snapshot():
            kept.add_metric([m.name], m.kept_bytes)
        yield kept


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.jobs_total = Counter("diffusiond_jobs_total", "Jobs that ended, by status", ["status"],
                                  registry=self.registry)
        self.rejected_total = Counter("diffusiond_rejected_total", "Requests refused at admission, by reason",
                                      ["reason"], registry=self.registry)
        self.batch_size = Histogram("diffusiond_batch_size", "Outputs per batch sent to a worker",
                                    buckets=(1, 2, 4, 8, 16, 32), registry=self.registry)
        self.stage_seconds = Histogram("diffusiond_stage_seconds", "Time spent per stage", ["stage"],
                                       buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.previews_sent = Counter("diffusiond_previews_sent", "Preview events written to SSE streams",
                                     registry=self.registry)
        self.previews_dropped = Counter(
            "diffusiond_previews_dropped",
            "Previews replaced by a newer one before a stream (or the encoder) got to them",
            registry=self.registry)
        self.worker_restarts = Counter("diffusiond_worker_restarts_total", "Workers replaced after they ended",
                                       ["model"], registry=self.registry)
        self.model_loads_total = Counter("diffusiond_model_loads_total", "Models brought onto their device",
                                         ["model"], registry=self.registry)
        self.model_evictions_total = Counter("diffusiond_model_evictions_total",
                                             "Models that left their device, by reason", ["model", "reason"],
                                             registry=self.registry)
        self.kept_released_total = Counter(
            "diffusiond_kept_host_copies_released_total", "Host copies kept by models on their devices that were "
            "freed, by reason: host_memory_full (room for another), disk (the workers stopped), worker_died",
            ["reason"], registry=self.registry)
        self.kept_released_bytes = Counter("diffusiond_kept_host_bytes_released_total",
                                           "Bytes of the kept host copies freed, by reason (as above)", ["reason"],
                                           registry=self.registry)
        self.model_load_seconds = Histogram("diffusiond_model_load_seconds", "Time to bring a model onto its device",
                                            buckets=(0.1, 0.3, 1, 3, 10, 30, 100, 300), registry=self.registry)
        self.web_sessions = Counter("diffusiond_web_sessions_total", "Sign-ins to the web page (token URL opened)",
                                    registry=self.registry)
        self.web_refused = Counter("diffusiond_web_refused_total", "Web listener requests refused, by reason",
                                   ["reason"], registry=self.registry)

    def kept_released(self, reason: str, nbytes: int) -> None:
        """A model's kept host copy (``nbytes`` of it) is gone: freed for room, or with its workers."""
        if nbytes > 0:
            self.kept_released_total.labels(reason).inc()
            self.kept_released_bytes.labels(reason).inc(nbytes)

    def bind(self, snapshot: Callable[[], dict[str, Any]],
             residency: Callable[[], Iterable[ModelStatus]] | None = None) -> None:
        self.registry.register(_StateCollector(snapshot))
        if residency is not None:
            self.registry.register(_ResidencyCollector(residency))

    def render(self) -> bytes:
        return generate_latest(self.registry)
