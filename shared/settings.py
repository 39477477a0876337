"""Settings shared by the services; each service adds its own class on top.

Values come from environment variables with the service's prefix, then CLI
flags (``--http-port 8100``) on top. Bind and advertised addresses are separate
so nodes work behind port mappings, NAT and proxies.
"""

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.errors import SecretError

LogFormat = Literal["plain", "json"]
ZmqSecurity = Literal["curve", "plain"]
Transport = Literal["tcp", "rdma", "nvlink"]
# Read when a service's own join-token settings are unset, so one variable serves them all.
SHARED_JOIN_TOKEN = "KVROOM_JOIN_TOKEN"
SHARED_JOIN_TOKEN_FILE = "KVROOM_JOIN_TOKEN_FILE"


def read_secret(value: str | None, path: Path | None, what: str) -> str | None:
    """A secret given directly or in a file (its first line); None if neither is set."""
    if path is not None:
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise SecretError(f"cannot read the {what} file {path}: {exc}") from exc
        text = lines[0].strip() if lines else ""
        if not text:
            raise SecretError(f"the {what} file {path} is empty")
        return text
    return value or None


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(
        cli_kebab_case=True, cli_implicit_flags=True, extra="forbid", cli_hide_none_type=True
    )

    host: str = Field("127.0.0.1", description="address the HTTP and ZMQ sockets bind to")
    advertise_host: str | None = Field(
        None, description="address peers use to reach this service (default: host)"
    )
    http_port: int = Field(ge=1, le=65535, description="HTTP port (health, metrics, API)")
    advertise_http_port: int | None = Field(None, ge=1, le=65535, description="HTTP port peers use")
    zmq_port: int = Field(ge=1, le=65535, description="ZMQ port (rank r of a node binds zmq_port + r)")
    advertise_zmq_port: int | None = Field(None, ge=1, le=65535, description="ZMQ port peers use")
    log_format: LogFormat = Field("plain", description="plain or json log lines")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="logging level")
    zmq_security: ZmqSecurity = Field(
        "curve", description="curve: authenticated, encrypted ZMQ; plain: none (tests on one machine only)"
    )
    curve_key_file: Path | None = Field(
        None,
        description="this service's CURVE secret key file (from `python -m bootstrap keys`); "
        "default: a key made at start-up",
    )
    join_token: SecretStr | None = Field(
        None, description=f"secret a node must present to join (default: ${SHARED_JOIN_TOKEN})"
    )
    join_token_file: Path | None = Field(
        None, description=f"file holding the join secret (default: ${SHARED_JOIN_TOKEN_FILE})"
    )

    @model_validator(mode="after")
    def _bind_all_needs_advertise(self) -> "ServiceSettings":
        if self.host in ("0.0.0.0", "::") and not self.advertise_host:
            raise ValueError("binding to all interfaces needs --advertise-host")
        return self

    def resolved_join_token(self) -> str | None:
        """The join secret from the settings, or else from the variables all services share."""
        if self.join_token is not None or self.join_token_file is not None:
            token = self.join_token.get_secret_value() if self.join_token else None
            return read_secret(token, self.join_token_file, "join token")
        shared_file = os.environ.get(SHARED_JOIN_TOKEN_FILE)
        return read_secret(
            os.environ.get(SHARED_JOIN_TOKEN), Path(shared_file) if shared_file else None, "join token"
        )

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
