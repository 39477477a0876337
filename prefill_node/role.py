"""The prefill role: what ``shared.node.builder`` builds a prefill node from."""

from prefill_node.service import PrefillService
from prefill_node.settings import PrefillSettings
from shared.node.builder import Role

PREFILL = Role("prefill", PrefillService, PrefillSettings)
