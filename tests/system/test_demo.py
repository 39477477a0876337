"""The demo that `bash run.sh` runs, with a Hugging Face model made on the fly: every output checked."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_runs_a_tiny_model_and_checks_every_room(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.demo",
            "--model",
            "tiny-qwen2",
            "--rooms",
            "4",
            "--max-new-tokens",
            "8",
            "--log-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "4/4 rooms SUCCESS with output equal to the colocated run" in out.stdout
