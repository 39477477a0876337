"""A vLLM instance's settings as a kvroom node: ``kv_connector_extra_config``, then ``KVROOM_VLLM_*``
variables, then kvroom's shared ones (``KVROOM_JOIN_TOKEN``).

They are a node's settings less what vLLM decides itself (the model, its dtype, the pages, the
tensor-parallel size): those are read from vLLM's configuration, and refused here so that a value
that would be ignored is never given silently.
"""

from typing import Any
from urllib.parse import urlparse

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from shared.node.settings import NodeSettings

# Node settings vLLM decides through its own flags.
DECIDED_BY_VLLM = frozenset(
    {
        "model",
        "dtype",
        "num_pages",
        "page_size",
        "tp_size",
        "device",
        "gpus",
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "agreement",
        "dist_port",
        "scatter_pages",
        "drain_grace_s",
        "http_port",
        "advertise_http_port",
    }
)


class VllmNodeSettings(NodeSettings):
    model_config = SettingsConfigDict(env_prefix="KVROOM_VLLM_")

    http_url: str = Field(
        description="this vLLM server's OpenAI endpoint as the bootstrap reaches it, e.g. http://10.0.0.5:8100",
        pattern=r"^https?://[^\s/]+:\d{1,5}/?$",
    )
    transfer_timeout_s: float = Field(
        30.0, gt=0, description="seconds a room may take from its request to its validated KV"
    )
    aux_timeout_s: float = Field(
        5.0, gt=0, description="seconds a room may wait for an intact aux record once its KV is done"
    )
    aux_slots: int = Field(1024, ge=1, le=1 << 16, description="aux records a decode rank can hold at once")

    @model_validator(mode="before")
    @classmethod
    def _port_from_url(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refused = sorted(DECIDED_BY_VLLM & set(data))
            if refused:
                raise ValueError(f"{', '.join(refused)}: vLLM decides these through its own flags")
            url = data.get("http_url")
            if isinstance(url, str) and urlparse(url).port:
                data = {**data, "http_port": urlparse(url).port}
        return data


def settings_from(extra: dict[str, Any]) -> VllmNodeSettings:
    """The settings from vLLM's ``kv_connector_extra_config``; ValueError says what is wrong."""
    return VllmNodeSettings(**extra)
