"""A Docker engine for the deployment tests, and what an image build needs on a host that cannot
reach the usual registries: a base image made from Debian packages, a CPU torch wheel served as a
package index on 127.0.0.1, and the CA bundle the host's pip trusts.

On an ordinary host none of that is made: the default base image is pulled and the default
indexes are used, as a user's `docker compose build` would.
"""

import contextlib
import http.server
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"
CPU_BASE = "debian:bookworm-slim"
LOCAL_BASE = "kvroom-test-base:bookworm"


class NoDocker(Exception):
    """Docker cannot run images here; the message says why."""


def docker(*args: str, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=check, **kw
    )


def answers() -> bool:
    try:
        return docker("info", timeout=20, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@contextlib.contextmanager
def engine(log_dir: Path) -> Iterator[None]:
    """A Docker engine that answers: the host's, or a dockerd started here and stopped after."""
    if shutil.which("docker") is None:
        raise NoDocker("no docker client (bash setup.sh cpu,dev installs one)")
    if answers():
        yield
        return
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        raise NoDocker("no Docker engine answers and none can be started here (dockerd as root)")
    log = log_dir / "dockerd.log"
    with log.open("w") as out:
        daemon = subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT)
    try:
        with contextlib.suppress(TimeoutError):
            until(lambda: daemon.poll() is not None or answers(), timeout=60, what="dockerd answers")
        if daemon.poll() is not None or not answers():
            raise NoDocker(f"dockerd did not start: {log.read_text()[-600:]}")
        yield
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10):
            return True
    except OSError:
        return False


def host_pip(key: str) -> str | None:
    """A setting of the host's pip (environment first, then its configuration files)."""
    value = os.environ.get("PIP_" + key.upper().replace("-", "_"))
    if value:
        return value
    out = subprocess.run(
        ["python3", "-m", "pip", "config", "get", f"global.{key}"], capture_output=True, text=True
    )
    return out.stdout.strip() or None if out.returncode == 0 else None


@dataclass
class BuildInputs:
    """The build arguments (compose's KVROOM_* variables) a CPU image build takes on this host."""

    env: dict[str, str] = field(default_factory=dict)
    ca_bundle: Path | None = None
    made: list[str] = field(default_factory=list)  # images made here, removed after


def base_image(work: Path, inputs: BuildInputs) -> None:
    """The default base image if it can be pulled; else one made from Debian packages."""
    if docker("pull", CPU_BASE, check=False, timeout=300).returncode == 0:
        return
    if shutil.which("debootstrap") is None:
        raise NoDocker(f"{CPU_BASE} cannot be pulled and debootstrap is not installed")
    rootfs = work / "rootfs"
    made = subprocess.run(
        ["debootstrap", "--variant=minbase", "bookworm", str(rootfs)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if made.returncode != 0:
        raise NoDocker(f"{CPU_BASE} cannot be pulled and debootstrap failed: {made.stdout[-400:]}")
    shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    docker("import", "-", LOCAL_BASE, stdin=tar.stdout, timeout=300)
    tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)
    inputs.env["KVROOM_BASE_IMAGE"] = LOCAL_BASE
    inputs.made.append(LOCAL_BASE)


@contextlib.contextmanager
def torch_index(work: Path, inputs: BuildInputs) -> Iterator[None]:
    """The CPU torch index if it answers; else the wheel the host's pip has, served on 127.0.0.1."""
    if reachable("https://download.pytorch.org/whl/cpu/torch/"):
        yield
        return
    wheels = work / "torch-index"
    got = subprocess.run(
        ["python3", "-m", "pip", "download", "--no-deps", "--no-index", "-d", str(wheels), TORCH],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if got.returncode != 0:
        raise NoDocker(f"no CPU build of {TORCH}: its index is unreachable and the host's pip has none")
    (wheel,) = wheels.glob("torch-*.whl")
    (wheels / "torch").mkdir()
    (wheels / "torch" / "index.html").write_text(f'<a href="../{wheel.name}">{wheel.name}</a>\n')

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kw):
            super().__init__(*args, directory=str(wheels), **kw)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # The build reaches 127.0.0.1 only from the host's network.
    inputs.env["KVROOM_TORCH_INDEX_URL"] = f"http://127.0.0.1:{server.server_address[1]}/"
    inputs.env["KVROOM_BUILD_NETWORK"] = "host"
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def package_index(inputs: BuildInputs) -> None:
    """The index and CA bundle the host's pip uses, where they are not on this host's disk alone."""
    index = host_pip("index-url")
    if index and not index.startswith("file:"):
        inputs.env["KVROOM_PIP_INDEX_URL"] = index
    extra = [u for u in (host_pip("extra-index-url") or "").split() if not u.startswith("file:")]
    if extra:
        inputs.env["KVROOM_PIP_EXTRA_INDEX_URL"] = " ".join(extra)
    cert = host_pip("cert")
    if cert and Path(cert).is_file():
        inputs.ca_bundle = Path(cert)


@contextlib.contextmanager
def cpu_build_inputs() -> Iterator[BuildInputs]:
    inputs = BuildInputs()
    with tempfile.TemporaryDirectory(prefix="kvroom-docker-") as tmp:
        work = Path(tmp)
        try:
            base_image(work, inputs)
            package_index(inputs)
            with torch_index(work, inputs):
                yield inputs
        finally:
            for image in inputs.made:
                docker("rmi", "-f", image, check=False)


def checkout_copy(dest: Path, ca_bundle: Path | None) -> Path:
    """The tracked files of this checkout, as a clean clone has them, plus the CA bundle to trust."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    if ca_bundle is not None:
        shutil.copy(ca_bundle, dest / "docker" / "ca-certificates" / "host-pip.crt")
    return dest


def wait_healthy(compose: list[str], services: set[str], timeout: float, env: dict[str, str]) -> None:
    def health() -> dict[str, str]:
        out = subprocess.run(
            [*compose, "ps", "--format", "{{.Service}} {{.Health}}"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        ).stdout
        return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)

    deadline = time.monotonic() + timeout
    seen: dict[str, str] = {}
    while time.monotonic() < deadline:
        seen = health()
        if all(seen.get(s) == "healthy" for s in services):
            return
        time.sleep(1)  # compose's health checks run every 5 s; this only polls their result
    raise AssertionError(f"services not healthy within {timeout:.0f} s: {seen}")
