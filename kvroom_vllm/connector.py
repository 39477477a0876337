"""``KvroomConnector``: kvroom's transfer and its guarantee inside vLLM, as a KV connector.

Loaded by vLLM with::

    --kv-transfer-config '{"kv_connector": "KvroomConnector",
                           "kv_connector_module_path": "kvroom_vllm.connector",
                           "kv_role": "kv_producer",  # the prefill server; kv_consumer: decode
                           "kv_connector_extra_config": {"bootstrap_url": "http://...:8000",
                                                         "http_url": "http://<this server>:8100",
                                                         "zmq_port": 9100}}'

vLLM makes one connector in its scheduler (``kvroom_vllm.scheduler``) and one in each worker
(``kvroom_vllm.worker``); this class hands each call to its half.
"""

import dataclasses
import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.v1.outputs import KVConnectorOutput

from kvroom_vllm.messages import RankHandshake, StepPlan, WorkerReport
from kvroom_vllm.paged_kv import paged_kv
from kvroom_vllm.scheduler import SchedulerHalf, model_identity
from kvroom_vllm.settings import settings_from
from kvroom_vllm.stats import WritePromMetrics, WriteStats
from kvroom_vllm.worker import WorkerHalf
from shared.kv.head_split import kv_heads

log = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """kvroom's own loggers write where vLLM's do, at INFO."""
    vllm_logger = logging.getLogger("vllm")
    for name in ("kvroom_vllm", "shared"):
        ours = logging.getLogger(name)
        if not ours.handlers:
            for handler in vllm_logger.handlers:
                ours.addHandler(handler)
            ours.setLevel(logging.INFO)
            ours.propagate = False


class KvroomConnector(KVConnectorBase_V1):
    worker_class = WorkerHalf  # what a worker process runs (a test's subclass may watch it)

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        transfer_config = self._kv_transfer_config
        if transfer_config.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError("KvroomConnector: kv_role is kv_producer (prefill) or kv_consumer (decode)")
        policy = getattr(transfer_config, "kv_load_failure_policy", "fail")
        if policy != "fail":
            raise ValueError(
                f'KvroomConnector: kv_load_failure_policy must be "fail", not {policy!r}: with it, a load '
                "that did not pass kvroom's gate would be computed over, and no KV counts before it landed"
            )
        side = "prefill" if transfer_config.kv_role == "kv_producer" else "decode"
        settings = settings_from(dict(transfer_config.kv_connector_extra_config or {}))
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        self._report = WorkerReport()
        self._invalid: set[int] = set()
        num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerHalf(model_identity(vllm_config), settings, side, num_blocks)
        else:
            model = vllm_config.model_config
            self._worker = self.worker_class(
                settings,
                get_tensor_model_parallel_rank(),
                get_tensor_model_parallel_world_size(),
                model.get_total_num_kv_heads(),
                model.get_vocab_size(),
                side,
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Head-major blocks, layer after layer: the heads one rank writes into another are then one
        contiguous range of each block (``kvroom_vllm.paged_kv``)."""
        return "LBHNC"

    # -- scheduler side ----------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.set_free_blocks(gpu_block_pool.get_num_free_blocks)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self._scheduler is not None
        self._scheduler.start({r: m for r, m in metadata.items() if isinstance(m, RankHandshake)})

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        if num_external_tokens > 0:
            self._scheduler.allocated(request, blocks.get_unhashed_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.step_plan()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request, block_ids), None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.took_output(connector_output)

    # -- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        w = self._worker
        w.start(paged_kv(kv_caches, kv_heads(w.rank, w.tp_size, w.num_kv_heads)))

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.handshake() if self._worker is not None and self._worker.kv is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's plan goes to the rank now, before the forward: vLLM calls ``start_load_kv``
        after the forward is launched, which on a CPU is after it has run. Loads into a KV cache on
        a GPU wait for ``start_load_kv``: the zeroing of their new blocks may still be queued."""
        super().bind_connector_metadata(connector_metadata)
        assert self._worker is not None and self._worker.kv is not None
        assert isinstance(connector_metadata, StepPlan)
        if self._worker.kv.on_host:
            self._worker.take_plan(connector_metadata)
        else:
            self._worker.take_plan(dataclasses.replace(connector_metadata, loads=[]))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None and self._worker.kv is not None
        plan = self._get_connector_metadata()
        assert isinstance(plan, StepPlan)
        if not self._worker.kv.on_host:
            self._worker.take_plan(StepPlan(loads=plan.loads))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous, whole rooms at a time: nothing to wait for inside a step."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """A prompt's KV is sent once the request finished, from its blocks: nothing per layer."""

    def wait_for_save(self) -> None:
        """Sends read blocks vLLM keeps until they are done (``request_finished``)."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, invalid, report = self._worker.results()
        self._invalid, self._report = invalid, report
        return KVConnectorTransferResults(sending, recving, set())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def build_connector_worker_meta(self) -> WorkerReport | None:
        report, self._report = self._report, WorkerReport()
        return report if report.failed or report.transferring or report.ready else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return WriteStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any
    ) -> KVConnectorPromMetrics | None:
        return WritePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
