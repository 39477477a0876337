"""Two versions of kvroom side by side: another commit's tree, each version's own imports, and
a verdict per row (``python -m bench --against REF``)."""

import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def git(tree: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


@contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """``ref`` checked out in a temporary directory, removed on the way out."""
    with tempfile.TemporaryDirectory(prefix="kvroom-against-") as tmp:
        tree = Path(tmp) / "tree"
        git(ROOT, "worktree", "add", "--detach", str(tree), ref)
        try:
            yield tree
        finally:
            git(ROOT, "worktree", "remove", "--force", str(tree))


def describe(tree: Path) -> dict[str, Any]:
    return {
        "commit": git(tree, "rev-parse", "HEAD"),
        "subject": git(tree, "log", "-1", "--format=%s"),
        "local_changes": bool(git(tree, "status", "--porcelain", "--untracked-files=no")),
    }


def tree_env(tree: Path) -> dict[str, str]:
    """The environment under which a service imports kvroom from ``tree``: the tree on
    PYTHONPATH, ahead of the installed kvroom, and the working directory kept off sys.path
    (PYTHONSAFEPATH). Checked here, as the package layout differs between versions."""
    env = {"PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"}
    probe = "import bootstrap, decode_node, prefill_node, shared\n"
    probe += "for package in (bootstrap, decode_node, prefill_node, shared): print(package.__file__)"
    found = subprocess.run(
        [sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True, text=True, check=True
    ).stdout.split()
    if not all(Path(path).is_relative_to(tree) for path in found):
        raise RuntimeError(f"kvroom is not imported from {tree}: {found}")
    return env


def compare(old: list[float], new: list[float], lower_is_better: bool) -> dict[str, Any]:
    """One row: each version's median, the median of the runs' ratios (new ÷ old, the two taken
    next to each other), and the verdict within a tolerance taken from those ratios' spread."""
    ratios = [n / o for o, n in zip(old, new, strict=True)]
    ratio = statistics.median(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    # Three standard errors of the median: sigma from the interquartile range (IQR / 1.35), a
    # median's error 1.25 sigma / sqrt(runs). Three, not two: a run judges some thirty rows,
    # and an unchanged version should come out not worse on all of them.
    tolerance = 3 * 1.25 * (q3 - q1) / 1.35 / math.sqrt(len(ratios))
    worse = ratio > 1 + tolerance if lower_is_better else ratio < 1 - tolerance
    return {
        "better": "lower" if lower_is_better else "higher",
        "old": statistics.median(old),
        "new": statistics.median(new),
        "ratio": ratio,
        "tolerance": tolerance,
        "verdict": "worse" if worse else "not worse",
    }
