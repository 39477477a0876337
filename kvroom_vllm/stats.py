"""What a server's ranks wrote, and how the blocks of failed loads came back, for vLLM's stat
loggers: its periodic "KV Transfer metrics" log line and Prometheus counters on the server's
``/metrics`` (``vllm:kvroom_sends_total``, ``vllm:kvroom_writes_total``,
``vllm:kvroom_bytes_written_total``, and
``vllm:kvroom_failed_load_blocks_{answered,writers_gone,expired}_total``).

A send is one decode rank's blocks of one prompt, written whole; a write is one engine write
descriptor (a layer's run of blocks, for the heads one rank holds).
"""

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

# How a failed load's blocks came back to vLLM: once every writer answered, once the writers'
# process was known to have ended, or at the fence's end with the writers silent.
FREED = ("answered", "writers_gone", "expired")
COUNTS = ("sends", "writes", "bytes", *(f"freed_{how}" for how in FREED))
PROMETHEUS = {  # count: (its counter's name, what it counts)
    "sends": ("sends", "Prompts' KV a prefill rank wrote whole into a decode rank's blocks"),
    "writes": ("writes", "Engine write descriptors of those sends (a layer's run of blocks each)"),
    "bytes": ("bytes_written", "Bytes of KV those sends wrote"),
    "freed_answered": (
        "failed_load_blocks_answered",
        "Blocks of failed loads given back to vLLM once every writer had answered",
    ),
    "freed_writers_gone": (
        "failed_load_blocks_writers_gone",
        "Blocks of failed loads given back once their prefill process had ended and what it sent had landed",
    ),
    "freed_expired": (
        "failed_load_blocks_expired",
        "Blocks of failed loads given back at their fence's end, their writers silent",
    ),
}


@dataclass
class WriteStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for key in COUNTS:
            self.data.setdefault(key, 0)

    def record(self, writes: int, nbytes: int) -> None:
        self.data["sends"] += 1
        self.data["writes"] += writes
        self.data["bytes"] += nbytes

    def freed(self, how: str, blocks: int) -> None:
        self.data[f"freed_{how}"] += blocks

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTS, 0)

    def aggregate(self, other: KVConnectorStats) -> "WriteStats":
        for key in COUNTS:
            self.data[key] += other.data.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        sends = self.data["sends"]
        return {
            "sends": sends,
            "writes": self.data["writes"],
            "writes_per_send": round(self.data["writes"] / sends, 1) if sends else 0,
            "MiB": round(self.data["bytes"] / 2**20, 2),
            **{f"failed_load_blocks_{how}": self.data[f"freed_{how}"] for how in FREED},
        }

    def is_empty(self) -> bool:
        return not any(self.data.values())


class WritePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine: Any):
        super().__init__(vllm_config, metric_types, labelnames, per_engine)
        self.counters: dict[str, dict[int, Any]] = {
            key: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvroom_{name}", documentation=doc, labelnames=labelnames),
                per_engine,
            )
            for key, (name, doc) in PROMETHEUS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, counter in self.counters.items():
            counter[engine_idx].inc(transfer_stats_data.get(key, 0))
