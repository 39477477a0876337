"""vLLM's own MooncakeConnector on vLLM's CPU build, for the benchmark's reference PD pair.

Loaded by the vLLM servers (``kv_connector_module_path: bench.mooncake_cpu``, kv_connector
``CpuMooncakeConnector``), never by kvroom. It changes nothing in how Mooncake moves KV; it only
gets the connector past two assumptions of a GPU host:

- the worker asks ``torch.accelerator.current_device_index()`` for its CUDA device before it
  starts the transfer engine, which raises on a host with no accelerator ("Cannot access
  accelerator device when none is available"); on CPU the device is 0, and vLLM's CPU platform
  ``set_device`` ignores it;
- the prefill's Mooncake bootstrap server (where a decode looks up the prefill's workers) binds
  0.0.0.0; here it binds 127.0.0.1 like everything else the benchmark starts.
"""

# With vLLM installed these attributes are typed, without it they are not.
# mypy: disable-error-code="unused-ignore"

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mooncake
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import MooncakeBootstrapServer


class LoopbackBootstrapServer(MooncakeBootstrapServer):
    def __init__(self, host: str, port: int):
        super().__init__("127.0.0.1", port)


@contextlib.contextmanager
def _cpu_host() -> Iterator[None]:
    index = torch.accelerator.current_device_index
    server = mooncake.MooncakeBootstrapServer
    if not torch.accelerator.is_available():
        torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]
    mooncake.MooncakeBootstrapServer = LoopbackBootstrapServer  # type: ignore[misc]
    try:
        yield
    finally:
        torch.accelerator.current_device_index = index  # type: ignore[assignment]
        mooncake.MooncakeBootstrapServer = server  # type: ignore[misc]


class CpuMooncakeConnector(mooncake.MooncakeConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
        with _cpu_host():
            super().__init__(vllm_config, role, kv_cache_config)
