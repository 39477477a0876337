"""Tiers, marked by folder: ``unit`` (no services), ``integration`` (real processes on 127.0.0.1),
``system`` (the benchmark, the demo, a browser, deployment files, the README). ``pytest -m unit``
runs one tier; the README's test command runs them all."""

import importlib.util

import pytest

pytest_plugins = ["tests.support.stacks"]
# The vLLM connector's unit tests import vLLM: test.sh runs them with .venv-vllm's Python.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["unit/vllm"]
TIERS = ("unit", "integration", "system")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = next((t for t in TIERS if f"/tests/{t}/" in str(item.path)), None)
        if tier is not None:
            item.add_marker(tier)
