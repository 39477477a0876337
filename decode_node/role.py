"""The decode role: what ``shared.node.builder`` builds a decode node from, with its own gauges."""

from decode_node.service import DecodeService
from decode_node.settings import DecodeSettings
from shared.metrics import ServiceMetrics
from shared.node.builder import Node, Role


def decode_gauges(metrics: ServiceMetrics, node: Node) -> None:
    metrics.gauge_function(
        "kvroom_free_aux_slots",
        "Free aux slots (the fewest of any rank)",
        lambda: node.health()["free_aux_slots"],
    )
    total = node.health()["total_aux_slots"]
    metrics.gauge_function("kvroom_total_aux_slots", "Aux slots of each rank", lambda: total)
    metrics.gauge_function(
        "kvroom_fenced_pages",
        "Pages of failed rooms held until their writers give them back or the lease ends (all ranks)",
        lambda: node.health()["fenced_pages"],
    )
    metrics.counter_function(
        "kvroom_lent_pages_closed_total",
        "Pages lent to prefill ranks' writes whose lease closed, by how: returned (the writer said its "
        "writes ended), revoked (the writer is gone for certain: it left or restarted), expired (no "
        "word from it within lease_timeout_s)",
        "how",
        lambda: node.health()["lent_pages_closed"],
    )


DECODE = Role("decode", DecodeService, DecodeSettings, decode_gauges)
