"""The connector's write counts as vLLM's stat loggers take them: summed over workers and steps,
reduced for the log line, and added to Prometheus counters on the server's ``/metrics``."""

import functools

import prometheus_client
from prometheus_client import Counter, Gauge, Histogram

from kvroom_vllm.connector import KvroomConnector
from kvroom_vllm.stats import WritePromMetrics, WriteStats


class Config:
    kv_transfer_config = None


def test_counts_from_workers_and_steps_add_up_and_reduce_to_writes_per_send():
    one, other = WriteStats(), WriteStats()
    assert one.is_empty()
    one.record(writes=4, nbytes=3 << 20)
    other.record(writes=2, nbytes=1 << 20)
    other.record(writes=6, nbytes=0)
    # The scheduler sums the workers' stats; the API server rebuilds them from their dict.
    total = KvroomConnector.build_kv_connector_stats(one.aggregate(other).to_dict())
    assert total is not None and not total.is_empty()
    assert total.reduce() == {
        "sends": 3,
        "writes": 12,
        "writes_per_send": 4.0,
        "MiB": 4.0,
        "failed_load_blocks_answered": 0,
        "failed_load_blocks_writers_gone": 0,
        "failed_load_blocks_expired": 0,
    }
    total.reset()
    assert total.is_empty() and total.reduce()["writes_per_send"] == 0


def test_prometheus_counters_grow_by_each_observation():
    registry = prometheus_client.CollectorRegistry()  # not the process's default one
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    metrics = KvroomConnector.build_prom_metrics(Config(), types, ["engine"], {0: ["0"]})
    assert isinstance(metrics, WritePromMetrics)
    stats = WriteStats()
    stats.record(writes=3, nbytes=1024)
    stats.freed("writers_gone", 5)
    metrics.observe(stats.to_dict())
    metrics.observe(stats.to_dict())
    got = {s.name: s.value for m in registry.collect() for s in m.samples if s.name.endswith("_total")}
    assert got == {
        "vllm:kvroom_sends_total": 2.0,
        "vllm:kvroom_writes_total": 6.0,
        "vllm:kvroom_bytes_written_total": 2048.0,
        "vllm:kvroom_failed_load_blocks_answered_total": 0.0,
        "vllm:kvroom_failed_load_blocks_writers_gone_total": 10.0,
        "vllm:kvroom_failed_load_blocks_expired_total": 0.0,
    }
