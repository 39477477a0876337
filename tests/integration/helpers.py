from pathlib import Path
from typing import Any

import httpx

from launcher.local_stack import Service

# Real nodes with one thing broken on purpose (tests/integration/hooked_node.py).
HOOKED = "tests.integration.hooked_node"


def node_transfer(service: Service, transfer: int) -> dict[str, Any] | None:
    """A node's own view of a transfer (a room's first placement has the room's id)."""
    resp = httpx.get(f"{service.url}/transfers/{transfer}", timeout=5.0)
    return resp.json() if resp.status_code == 200 else None


def metric(service: Service, name: str, labels: str = "") -> float:
    """The value of one sample from the service's /metrics, 0 if absent."""
    text = httpx.get(f"{service.url}/metrics", timeout=5.0).text
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


def pools_full(*services: Service) -> bool:
    for service in services:
        h = service.health()
        if h["free_pages"] != h["total_pages"] or h.get("free_aux_slots") != h.get("total_aux_slots"):
            return False
        if h["rooms_in_flight"]:
            return False
    return True


def late_write_prefill(stack, node_id: str, args: list[str], release: Path) -> Service:
    """A prefill node (not started) whose first KV write is held until ``release`` exists."""
    env = {
        "KVROOM_TEST_HOOK": "late-write",
        "KVROOM_TEST_ROLE": "prefill",
        "KVROOM_TEST_RELEASE_FILE": str(release),
    }
    return stack.node("prefill", node_id, args, module=HOOKED, env=env)
