"""The decode role: what ``shared.node.builder`` builds a decode node from, with its aux-slot gauges."""

from decode_node.service import DecodeService
from decode_node.settings import DecodeSettings
from shared.metrics import ServiceMetrics
from shared.node.builder import Node, Role


def aux_slot_gauges(metrics: ServiceMetrics, node: Node) -> None:
    metrics.gauge_function(
        "kvroom_free_aux_slots",
        "Free aux slots (the fewest of any rank)",
        lambda: node.health()["free_aux_slots"],
    )
    total = node.health()["total_aux_slots"]
    metrics.gauge_function("kvroom_total_aux_slots", "Aux slots of each rank", lambda: total)


DECODE = Role("decode", DecodeService, DecodeSettings, aux_slot_gauges)
