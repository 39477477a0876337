from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.kv.transfer import WRITE_TIMEOUT_S
from shared.node.settings import NodeSettings


class PrefillSettings(NodeSettings):
    """Settings of a prefill node; env prefix KVROOM_PREFILL_."""

    model_config = SettingsConfigDict(env_prefix="KVROOM_PREFILL_", cli_prog_name="python -m prefill_node")

    http_port: int = Field(8100, ge=1, le=65535, description="HTTP port (health, metrics)")
    zmq_port: int = Field(8101, ge=1, le=65535, description="ZMQ port (rank r binds zmq_port + r)")
    waiting_timeout_s: float = Field(
        30.0, gt=0, description="seconds a computed room may wait for its decode's transfer request"
    )
    write_timeout_s: float = Field(
        WRITE_TIMEOUT_S, gt=0, description="seconds a KV write may take (plus one per GB) before it gives up"
    )
    progress_notice_s: float = Field(
        0.05,
        ge=0,
        description="seconds a room's write may take before its decode is told the request was accepted "
        "and the write began (0: at once); a room whose done+aux goes out sooner sends only that",
    )
    early_request_ttl_s: float = Field(
        10.0, gt=0, description="how long a transfer request that beat its room is kept"
    )
    max_early_requests: int = Field(4096, ge=1, description="cap on transfer requests kept early")
