"""The images' build steps, checked without a Docker engine: what each COPY brings past .dockerignore,
and each Python install step performed with pip (a dry run) on a copy of exactly what the image has
at that step. The real builds are in test_compose_stack.py, where an engine runs."""

import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.support.docker_host import reachable
from tests.support.dockerfile import context_files, copy_of, instructions

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile", "Dockerfile.cpu", "Dockerfile.vllm")
TRACKED = [
    f
    for f in subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    if f and "__pycache__" not in f
]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copy_brings_every_tracked_file_it_names(name):
    copies = [c for c in map(copy_of, instructions(ROOT / "docker" / name)) if c is not None]
    assert copies
    for copy in copies:
        for source in copy.sources:
            under = [f for f in TRACKED if f == source.strip("/") or f.startswith(source.strip("/") + "/")]
            assert under, f"{name}: COPY {source}: no such file in the checkout"
            brought = context_files(ROOT, TRACKED, source)
            dropped = sorted(set(under) - set(brought))
            assert not dropped, f"{name}: COPY {source}: .dockerignore drops {dropped}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_runs_as_a_user_and_has_no_syntax_line(name):
    text = (ROOT / "docker" / name).read_text()
    assert not text.startswith("# syntax="), "a syntax line makes BuildKit pull a frontend from a registry"
    steps = instructions(ROOT / "docker" / name)
    last_stage = [i for i in steps if i.stage == steps[-1].stage]
    users = [i.args for i in last_stage if i.command == "USER"]
    assert users and users[-1] != "root"


@pytest.fixture(scope="module")
def pip_env(tmp_path_factory) -> dict[str, str]:
    """A fresh virtualenv, and a `pip` on PATH that only resolves what it is asked to install.

    The dry run is an argument, not PIP_DRY_RUN: pip's own build environments must install.
    """
    where = tmp_path_factory.mktemp("image-venv")
    venv.create(where / "venv", with_pip=True)
    shim = where / "shim"
    shim.mkdir()
    (shim / "pip").write_text(
        "#!/bin/sh\n"
        '[ "$1" = install ] && { shift; set -- install --dry-run --ignore-installed "$@"; }\n'
        f'exec {where / "venv" / "bin" / "pip"} "$@"\n'
    )
    (shim / "pip").chmod(0o755)
    env = dict(os.environ)
    env.update(PATH=os.pathsep.join([str(shim), str(where / "venv" / "bin"), env["PATH"]]))
    return env


def build_stage_args(name: str) -> dict[str, str]:
    """Every ARG's default, with a torch index this host reaches where the default is not."""
    args = {}
    for instruction in instructions(ROOT / "docker" / name):
        if instruction.command == "ARG":
            key, _, value = instruction.args.partition("=")
            args[key] = value
    torch = args.get("TORCH_INDEX_URL")
    if torch and not reachable(torch.rstrip("/") + "/torch/"):
        args["TORCH_INDEX_URL"] = "https://pypi.org/simple"  # with the host's pip's own wheels
    return args


def placed(source: str, dest: Path, into_dir: bool) -> list[tuple[str, Path]]:
    """Where COPY puts each file: a folder's contents go into dest; a file to dest, or into it."""
    source = source.strip("/")
    out = []
    for file in context_files(ROOT, TRACKED, source):
        if file == source:
            out.append((file, dest / Path(file).name if into_dir else dest))
        else:
            out.append((file, dest / Path(file).relative_to(source)))
    return out


@pytest.mark.parametrize("name", DOCKERFILES)
def test_each_install_step_works_on_what_the_image_has_then(name, pip_env, tmp_path):
    """Replays the Dockerfile's COPY and WORKDIR steps under a scratch root, and runs each RUN
    that installs Python packages there, in order, as the build would."""
    root = tmp_path / "root"
    workdir = root
    env = {**pip_env, **build_stage_args(name)}
    ran = 0
    for instruction in instructions(ROOT / "docker" / name):
        if instruction.command == "WORKDIR":
            workdir = root / instruction.args.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif (copy := copy_of(instruction)) is not None:
            dest = workdir / copy.dest if not copy.dest.startswith("/") else root / copy.dest.lstrip("/")
            for source in copy.sources:
                into_dir = copy.dest.endswith("/") or len(copy.sources) > 1
                for file, into in placed(source, dest, into_dir):
                    into.parent.mkdir(parents=True, exist_ok=True)
                    into.write_bytes((ROOT / file).read_bytes())
        elif instruction.command == "RUN" and "pip install" in instruction.args:
            assert not re.search(r"\b(apt-get|useradd)\b", instruction.args), "keep system steps apart"
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", instruction.args],
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            said = done.stdout[-2000:] + done.stderr[-3000:]
            assert done.returncode == 0, f"{name}: RUN {instruction.args}\n{said}"
            ran += 1
    assert ran >= 1, f"{name} installs nothing with pip"


def test_the_dependency_layer_needs_pyproject_alone(tmp_path):
    """The layer's requirements come from pyproject.toml, pinned: the code is not needed to list them."""
    (tmp_path / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    (tmp_path / "requirements.py").write_bytes((ROOT / "docker" / "requirements.py").read_bytes())
    for extra, engine in (("cpu", "mooncake-transfer-engine-non-cuda"), ("cuda", "mooncake-transfer-engine")):
        listed = subprocess.run(
            [sys.executable, "requirements.py", extra], cwd=tmp_path, capture_output=True, text=True
        )
        out = listed.stdout.split()
        assert "torch==2.13.0" in out and any(r.startswith(engine + "==") for r in out)
        assert all("==" in r for r in out), out
    only = subprocess.run(
        [sys.executable, "requirements.py", "--only", "xxhash", "nonesuch"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert only.returncode == 2 and "nonesuch" in only.stderr
