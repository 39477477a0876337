from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from shared.settings import ServiceSettings, read_secret
from shared.wire import protocol


class BootstrapSettings(ServiceSettings):
    """Settings of the bootstrap service; env prefix KVROOM_BOOTSTRAP_."""

    model_config = SettingsConfigDict(env_prefix="KVROOM_BOOTSTRAP_", cli_prog_name="python -m bootstrap")

    http_port: int = Field(8000, ge=1, le=65535, description="HTTP port of the REST API")
    zmq_port: int = Field(8001, ge=1, le=65535, description="ZMQ port where nodes report room states")
    api_key: SecretStr | None = Field(
        None, description="key clients must present as Authorization: Bearer on /rooms (default: none asked)"
    )
    api_key_file: Path | None = Field(None, description="file holding the client API key")
    model: str = Field(
        "reference",
        description="the model the cluster serves, for its tokenizer: reference, synthetic, "
        "or the Hugging Face model directory (or cached hub id) the nodes load",
    )
    store: str = Field(
        "memory",
        pattern=r"^(memory|redis://.+)$",
        description="where nodes and rooms live: memory (this process) or redis://HOST:PORT/DB "
        "(shared by bootstraps, survives restarts)",
    )
    node_ttl_s: float = Field(5.0, gt=0, description="a node silent this long is marked dead")
    max_prompt_tokens: int = Field(
        4096, ge=1, le=protocol.MAX_TOKENS, description="longest prompt a room may carry, in tokens"
    )
    max_new_tokens: int = Field(
        1024, ge=1, le=protocol.MAX_TOKENS, description="most tokens a room may ask to generate"
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies are refused unread")
    max_wait_s: float = Field(60.0, gt=0, description="longest ?wait= a client may ask for")
    request_timeout_s: float = Field(
        300.0, gt=0, description="longest an OpenAI-style request waits for its room to finish"
    )
    room_history: int = Field(10_000, ge=1, description="finished rooms kept for GET /rooms")
    room_ttl_s: float = Field(3600.0, gt=0, description="how long a finished room is kept (Redis store)")
    room_deadline_s: float = Field(
        600.0,
        gt=0,
        description="a room not ended after this long ends FAILED deadline, whatever it waits for",
    )
    max_attempts: int = Field(
        2,
        ge=1,
        le=10,
        description="placements a room may get when it fails before any KV landed on its decode",
    )
    queue_limit: int = Field(
        256, ge=0, description="rooms that fit on no node now and wait for one; beyond, 503 with Retry-After"
    )

    def resolved_api_key(self) -> str | None:
        key = self.api_key.get_secret_value() if self.api_key else None
        return read_secret(key, self.api_key_file, "API key")
