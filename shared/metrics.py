"""Prometheus metrics; each service owns one registry (no process-global state) with its own families.

Every service: ``kvroom_info``, room transitions, failures and rooms by state,
messages received and rejected, and the process and Python GC collectors. A
prefill node adds what its writes moved; a decode node its aux latency and
slots; both their pages; the bootstrap its nodes and how long rooms take.
"""

from collections.abc import Callable, Iterator, Mapping

from fastapi.telemetry import TelemetryConfig
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shared.cli import VERSION
from shared.room.states import RoomState

__all__ = ["CONTENT_TYPE_LATEST", "NO_OPENTELEMETRY", "ServiceMetrics"]

# The services export Prometheus metrics. FastAPI's own OpenTelemetry hooks would
# look up the global providers on every request, which costs more than the request.
NO_OPENTELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}

# Up to the longest timeout a room can meet (the transfer timeout, 60 s by default; an
# OpenAI request may wait 300 s).
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
    120, 300,
)  # fmt: skip


class ServiceMetrics:
    def __init__(self, role: str, node_id: str = "", transport: str = ""):
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        Gauge(
            "kvroom_info", "Service identity", ["version", "role", "node_id", "transport"], registry=r
        ).labels(VERSION, role, node_id or role, transport or "-").set(1)
        self.transitions = Counter(
            "kvroom_room_transitions_total", "Room transitions by target state", ["state"], registry=r
        )
        # Every state's child made once: looking one up by label costs more than counting.
        self._transitions_to = {state.name: self.transitions.labels(state.name) for state in RoomState}
        self.failures = Counter(
            "kvroom_room_failures_total", "Rooms ended FAILED, by reason", ["reason"], registry=r
        )
        self.rejected = Counter(
            "kvroom_messages_rejected_total", "Messages dropped, by kind of fault", ["kind"], registry=r
        )
        self.received = Counter(
            "kvroom_messages_received_total", "ZMQ messages read from this service's sockets", registry=r
        )
        if role in ("prefill", "decode"):
            self.rooms = Gauge("kvroom_rooms", "Rooms on this node by current state", ["state"], registry=r)
        if role == "prefill":
            self.transfer_bytes = Counter(
                "kvroom_transfer_bytes_total", "KV bytes written to peers", registry=r
            )
            self.transfer_seconds = Histogram(
                "kvroom_transfer_seconds", "Time to write one room's KV", registry=r, buckets=LATENCY_BUCKETS
            )
        if role == "decode":
            self.aux_latency = Histogram(
                "kvroom_aux_latency_seconds",
                "From the prefill's KV-write completion to the room's SUCCESS on decode",
                registry=r,
                buckets=LATENCY_BUCKETS,
            )
            self.late_writes = Counter(
                "kvroom_late_writes_total",
                "Writes of prefill ranks that ended (done+aux or release) only after their room failed "
                "here: into pages still fenced for it",
                registry=r,
            )
        if role == "bootstrap":
            self.time_to_success = Histogram(
                "kvroom_time_to_success_seconds",
                "From a room's placement to its SUCCESS (KV and aux landed and validated)",
                registry=r,
                buckets=LATENCY_BUCKETS,
            )
            self.room_seconds = Histogram(
                "kvroom_room_seconds",
                "From a room's placement to its end, by how it ended",
                ["state"],
                registry=r,
                buckets=LATENCY_BUCKETS,
            )
            self.attempts = Counter(
                "kvroom_room_attempts_total", "Placements of rooms, first ones included", registry=r
            )
            self.replacements = Counter(
                "kvroom_room_replacements_total",
                "Rooms placed again after an attempt failed, by the failure",
                ["reason"],
                registry=r,
            )
            self.resent_assignments = Counter(
                "kvroom_room_assignments_resent_total",
                "Placed rooms whose assignments were sent again, no node having reported on them",
                registry=r,
            )

    def transitioned(self, state: str) -> None:
        """Count a room's transition into ``state``."""
        self._transitions_to[state].inc()

    def gauge_function(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        Gauge(name, doc, registry=self.registry).set_function(fn)

    def counter_function(
        self, name: str, doc: str, label: str, fn: Callable[[], Mapping[str, float]]
    ) -> None:
        """A counter read at scrape time, one sample a label value: for totals kept elsewhere (a
        node's ranks, which may be other processes)."""
        self.registry.register(_CounterFunction(name, doc, label, fn))

    def count_states(self, states: Callable[[], list[RoomState]]) -> None:
        """Sample rooms-by-state at scrape time from the live room table."""

        def collect_for(state: RoomState) -> Callable[[], float]:
            return lambda: float(sum(1 for s in states() if s is state))

        for state in RoomState:
            self.rooms.labels(state.name).set_function(collect_for(state))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CounterFunction:
    def __init__(self, name: str, doc: str, label: str, fn: Callable[[], Mapping[str, float]]):
        self.name, self.doc, self.label, self.fn = name, doc, label, fn

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.doc, labels=[self.label])
        for value, count in self.fn().items():
            family.add_metric([value], count)
        yield family
