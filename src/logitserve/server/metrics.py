"""Prometheus metrics: requests, failures by code, latency and queue time, batches, launches,
and the device the process runs on.

Each server owns a registry (several servers in one test process do not collide); with
``--metrics-port`` it is served over HTTP at ``/metrics``. Under ``--devices`` each device's
process serves its own (``--metrics-port`` + i), and ``logitserve_device_info{device="cuda:1"}``
says whose they are.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import GaugeMetricFamily

# Seconds: 50 us (a warm in-process call) to 10 s (a cold compile or a long queue).
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 10)
# Powers of two up to the largest --max-batch-rows anyone would set.
SIZE_BUCKETS = tuple(2.0**i for i in range(13))
# What callers hold on the server, read at each scrape from the state that holds it: all callers
# together as logitserve_<name>, and by owner as logitserve_<name>_by_owner{owner}, the owner
# being server/regions/names.py owner_of's digest of the bearer token ("" without one), never
# the token itself. GetServerInfo answers each caller its own figures only.
HOLDINGS = {
    "open_sequences": "Sequences open (OpenSequences; --max-sequences)",
    "sequence_bytes": "Bytes the open sequences' buffers hold (--max-sequence-bytes)",
    "regions": "Shared-memory regions mapped (--max-regions)",
    "region_bytes": "Bytes of shared-memory regions mapped (--max-region-bytes)",
    "held_answer_bytes": "Bytes of answers held for unfinished calls (--max-held-answer-bytes)",
}


class _Holdings:
    """The HOLDINGS gauges, from ``sources``: functions answering {owner: {name: value}}."""

    def __init__(self, sources):
        self.sources = sources

    def collect(self):
        by_owner = {name: {} for name in HOLDINGS}
        for read in self.sources:
            for owner, held in read().items():
                for name, value in held.items():
                    by_owner[name][owner or ""] = value
        for name, doc in HOLDINGS.items():
            yield GaugeMetricFamily(f"logitserve_{name}", f"{doc}, all callers together",
                                    value=sum(by_owner[name].values()))
            family = GaugeMetricFamily(f"logitserve_{name}_by_owner", f"{doc}, by owner (a digest of the bearer "
                                       f"token)", labels=["owner"])
            for owner, value in sorted(by_owner[name].items()):
                family.add_metric([owner], value)
            yield family


class Metrics:
    """The server's metrics in their own registry."""

    def __init__(self, device: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Constant 1, its label the torch device ("cuda:1", "cpu"): joins a process's series to its GPU.
        self.device = Info("logitserve_device", "The device this process runs its kernels on", registry=r)
        self.device.info({"device": device})
        self.requests = Counter("logitserve_requests", "RPCs received, by method", ["rpc"], registry=r)
        self.failures = Counter("logitserve_failures", "RPCs that ended with a status other than OK",
                                ["rpc", "code"], registry=r)
        self.latency = Histogram("logitserve_request_latency_seconds", "Time from an RPC's arrival to its answer",
                                 ["rpc"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("logitserve_queue_time_seconds", "Time a call waited in the batcher",
                                    ["op"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram("logitserve_batch_rows", "Rows per kernel launch", ["op"],
                                    buckets=SIZE_BUCKETS, registry=r)
        self.batch_requests = Histogram("logitserve_batch_requests", "Calls served per kernel launch", ["op"],
                                        buckets=SIZE_BUCKETS, registry=r)
        self.launches = Counter("logitserve_launches", "Kernel launches (one per batch)", ["op"], registry=r)
        self.queue_depth = Gauge("logitserve_queue_depth", "Calls waiting for a launch", registry=r)
        self.plan_cache = Gauge("logitserve_plan_cache_size", "Kernel descriptors cached", registry=r)
        self._http = None
        # Labelled children by label value: ``labels()`` costs a lock and a lookup per call.
        self._per_rpc: dict[str, tuple] = {}
        self._per_op: dict[str, tuple] = {}

    def watch_holdings(self, *sources) -> None:
        """Serve the HOLDINGS gauges, read from ``sources`` (functions answering {owner: {name:
        value}}: the sequences', regions' and held answers' ``holdings``) at each scrape."""
        self.registry.register(_Holdings(sources))

    def observe_batch(self, op: str, *, rows: int, requests: int, queue_seconds: list[float]) -> None:
        """One launch of ``op``: its rows, its calls, and how long each of them waited."""
        children = self._per_op.get(op)
        if children is None:
            children = self._per_op[op] = (self.launches.labels(op), self.batch_rows.labels(op),
                                           self.batch_requests.labels(op), self.queue_time.labels(op))
        launches, batch_rows, batch_requests, queue_time = children
        launches.inc()
        batch_rows.observe(rows)
        batch_requests.observe(requests)
        for seconds in queue_seconds:
            queue_time.observe(seconds)

    def observe_rpc(self, rpc: str, code_name: str, seconds: float) -> None:
        children = self._per_rpc.get(rpc)
        if children is None:
            children = self._per_rpc[rpc] = (self.requests.labels(rpc), self.latency.labels(rpc))
        requests, latency = children
        requests.inc()
        latency.observe(seconds)
        if code_name != "OK":
            self.failures.labels(rpc, code_name).inc()

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` over HTTP on ``port`` (in a daemon thread)."""
        self._http = start_http_server(port, addr=host, registry=self.registry)

    def close(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None
