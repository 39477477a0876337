"""Settings shared by the node services; each service adds its own class on top.

Values come from environment variables with the service's prefix, then CLI
flags (``--http-port 8100``) on top. Bind and advertised addresses are separate
so nodes work behind port mappings, NAT and proxies.
"""

import os
import socket
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.kv_layout import KVLayout
from shared.model import ModelConfig
from shared.transfer import Transport

LogFormat = Literal["plain", "json"]


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(cli_kebab_case=True, cli_implicit_flags=True, extra="forbid")

    host: str = Field("127.0.0.1", description="address the HTTP and ZMQ sockets bind to")
    advertise_host: str | None = Field(
        None, description="address peers use to reach this service (default: host)"
    )
    http_port: int = Field(ge=1, le=65535, description="HTTP port (health, metrics, API)")
    advertise_http_port: int | None = Field(None, ge=1, le=65535, description="HTTP port peers use")
    zmq_port: int = Field(ge=1, le=65535, description="ZMQ port (rank r of a node binds zmq_port + r)")
    advertise_zmq_port: int | None = Field(None, ge=1, le=65535, description="ZMQ port peers use")
    log_format: LogFormat = Field("plain", description="plain or json log lines")
    log_level: str = Field("INFO", description="logging level")

    @model_validator(mode="after")
    def _bind_all_needs_advertise(self) -> "ServiceSettings":
        if self.host in ("0.0.0.0", "::") and not self.advertise_host:
            raise ValueError("binding to all interfaces needs --advertise-host")
        return self

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def public_http_url(self) -> str:
        return f"http://{self.public_host}:{self.advertise_http_port or self.http_port}"

    def public_zmq_endpoint(self, offset: int = 0) -> str:
        return f"tcp://{self.public_host}:{(self.advertise_zmq_port or self.zmq_port) + offset}"

    def bind_zmq_endpoint(self, offset: int = 0) -> str:
        return f"tcp://{self.host}:{self.zmq_port + offset}"


class NodeSettings(ServiceSettings):
    node_id: str = Field("", description="unique node id (default: role-hostname-pid)")
    bootstrap_url: str = Field("http://127.0.0.1:8000", description="bootstrap service URL")
    transport: Transport = Field("tcp", description="KV transport: tcp, rdma or nvlink")
    rdma_devices: str = Field("", description="RDMA device names for the rdma transport, comma separated")
    engine_host: str | None = Field(
        None, description="hostname the transfer engine listens on (default: advertise host)"
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the KV pool lives")
    num_pages: int = Field(4096, ge=1, description="KV pages in this node's pool")
    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV page")
    kv_mode: Literal["model", "synthetic"] = Field(
        "model", description="model: run the reference model; synthetic: stamped pages, for benchmarks"
    )
    num_layers: int | None = Field(None, ge=1, le=1024, description="KV layers (synthetic mode only)")
    num_kv_heads: int | None = Field(None, ge=1, le=1024, description="KV heads (synthetic mode only)")
    head_dim: int | None = Field(None, ge=1, le=4096, description="head size (synthetic mode only)")
    kv_dtype: Literal["float32", "float16", "bfloat16"] | None = Field(
        None, description="KV element type (synthetic mode only)"
    )
    scatter_pages: bool = Field(False, description="hand out pages in shuffled order (coalescing benchmarks)")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="seconds between heartbeats")
    register_retry_s: float = Field(0.5, gt=0, description="seconds between registration attempts")

    @model_validator(mode="after")
    def _layout_only_for_synthetic_kv(self) -> "NodeSettings":
        given = [self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype]
        if self.kv_mode == "model" and any(v is not None for v in given):
            raise ValueError("the KV layout follows the reference model; set it only with kv_mode=synthetic")
        return self

    def kv_layout(self, model: ModelConfig) -> KVLayout:
        return KVLayout(
            self.num_layers or model.num_layers,
            self.num_kv_heads or model.num_heads,
            self.head_dim or model.head_dim,
            self.page_size,
            self.kv_dtype or "float32",
        )

    @model_validator(mode="after")
    def _cuda_needs_a_gpu(self) -> "NodeSettings":
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("device=cuda but this host has no usable CUDA device")
        return self

    def resolved_node_id(self, role: str) -> str:
        return self.node_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
