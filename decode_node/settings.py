from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.node.settings import NodeSettings


class DecodeSettings(NodeSettings):
    """Settings of a decode node; env prefix KVROOM_DECODE_."""

    model_config = SettingsConfigDict(env_prefix="KVROOM_DECODE_", cli_prog_name="python -m decode_node")

    http_port: int = Field(8200, ge=1, le=65535, description="HTTP port (health, metrics)")
    zmq_port: int = Field(8201, ge=1, le=65535, description="ZMQ port (rank r binds zmq_port + r)")
    aux_slots: int = Field(
        1024, ge=1, description="aux metadata slots per rank, one per room and prefill rank"
    )
    bootstrap_timeout_s: float = Field(
        10.0, gt=0, description="seconds a room may wait for its prefill ranks to accept the request"
    )
    waiting_timeout_s: float = Field(
        30.0, gt=0, description="seconds a room may wait for its prefill to start writing"
    )
    transfer_timeout_s: float = Field(
        60.0, gt=0, description="seconds a room may spend between the first write and done+aux"
    )
    aux_timeout_s: float = Field(
        5.0, gt=0, description="seconds a room may wait for an intact aux record once the KV is done"
    )
