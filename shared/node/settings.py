"""Settings every node has, whatever its role; each role adds its own class on top."""

import os
import socket
from typing import Literal

from pydantic import Field, model_validator

from shared.settings import ServiceSettings, Transport


class NodeSettings(ServiceSettings):
    node_id: str = Field("", description="unique node id (default: role-hostname-pid)")
    bootstrap_url: str = Field("http://127.0.0.1:8000", description="bootstrap service URL")
    bootstrap_public_key: str | None = Field(
        None,
        description="pin the bootstrap's CURVE public key (Z85 or a .key file); "
        "default: the key the bootstrap gives at registration",
    )
    transport: Transport = Field("tcp", description="KV transport: tcp, rdma or nvlink")
    rdma_devices: str = Field("", description="RDMA device names for the rdma transport, comma separated")
    engine_host: str | None = Field(
        None, description="hostname the transfer engine listens on (default: advertise host)"
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the model and KV pool live")
    gpus: str = Field(
        "", description="CUDA devices of ranks 0..n-1, comma separated (default: 0..n-1); with device=cuda"
    )
    tp_size: int = Field(1, ge=1, le=64, description="tensor-parallel ranks of this node, one process each")
    model: str = Field(
        "reference",
        description="reference (built-in model), synthetic (stamped pages, for benchmarks), "
        "or a Hugging Face model directory or hub id",
    )
    dtype: Literal["auto", "float64", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="model and KV element type (auto: float64 for the reference model, "
        "else float32 on CPU and bfloat16 on CUDA)",
    )
    num_pages: int = Field(4096, ge=1, description="KV pages in each rank's pool")
    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV page")
    num_layers: int | None = Field(None, ge=1, le=1024, description="KV layers (synthetic model only)")
    num_kv_heads: int | None = Field(None, ge=1, le=1024, description="KV heads (synthetic model only)")
    head_dim: int | None = Field(None, ge=1, le=4096, description="head size (synthetic model only)")
    verify_kv: bool = Field(
        False,
        description="digest every KV page on both sides and check before SUCCESS (costs a pass over the KV)",
    )
    agreement: Literal["ipc", "gloo"] = Field(
        "ipc",
        description="how the ranks of a node agree on room states: ipc (leader over ipc sockets) or gloo",
    )
    dist_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="port of the ranks' torch.distributed rendezvous (default: any free)",
    )
    scatter_pages: bool = Field(False, description="hand out pages in shuffled order (coalescing benchmarks)")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="seconds between heartbeats")
    register_retry_s: float = Field(
        0.5, gt=0, description="first wait before registering again; doubles up to 30 s while refused"
    )
    drain_grace_s: float = Field(
        30.0, ge=0, description="on SIGTERM, seconds rooms in flight may take to finish before they fail"
    )
    lease_timeout_s: float = Field(
        60.0, gt=0, description="seconds pages stay fenced while a peer's write may still be moving"
    )
    stay_up_on_rank_death: bool = Field(
        False,
        description="keep a node that lost a rank process running, broken, for debugging; by default "
        "it fails its rooms, leaves the cluster and exits with status 1, for its supervisor to restart",
    )

    @model_validator(mode="after")
    def _layout_only_for_synthetic_kv(self) -> "NodeSettings":
        given = [self.num_layers, self.num_kv_heads, self.head_dim]
        if self.model != "synthetic" and any(v is not None for v in given):
            raise ValueError("the KV layout follows the model; set it only with --model synthetic")
        if self.model == "reference" and self.dtype not in ("auto", "float64"):
            raise ValueError("the reference model computes in float64")
        return self

    @property
    def gpu_indices(self) -> list[int]:
        if not self.gpus:
            return list(range(self.tp_size))
        return [int(g) for g in self.gpus.split(",")]

    @model_validator(mode="after")
    def _cuda_needs_a_gpu(self) -> "NodeSettings":
        if self.gpus and not all(g.strip().isdigit() for g in self.gpus.split(",")):
            raise ValueError(f"gpus {self.gpus!r} is not a comma-separated list of device indices")
        if self.gpus and len(self.gpu_indices) != self.tp_size:
            raise ValueError(f"gpus names {len(self.gpu_indices)} devices for {self.tp_size} ranks")
        if self.device == "cuda":
            import torch

            missing = [g for g in self.gpu_indices if g >= torch.cuda.device_count()]
            if missing:
                raise ValueError(
                    f"device=cuda: CUDA devices {missing} are not visible; this host shows "
                    f"{torch.cuda.device_count()}"
                )
        return self

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        if self.model == "reference":
            return "float64"
        return "bfloat16" if self.device == "cuda" else "float32"

    def rank_device(self, rank: int) -> str:
        return "cpu" if self.device == "cpu" else f"cuda:{self.gpu_indices[rank]}"

    def resolved_node_id(self, role: str) -> str:
        return self.node_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
