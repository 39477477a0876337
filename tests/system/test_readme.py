"""The README documents every setting and failure reason, its generated blocks are current,
and it gives the two commands CI relies on."""

from pathlib import Path

import pytest

from bootstrap.settings import BootstrapSettings
from decode_node.settings import DecodeSettings
from launcher import readme
from prefill_node.settings import PrefillSettings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_generated_blocks_are_current():
    """`python -m launcher.readme` rewrites them: run it after changing a setting or benchmarking."""
    assert readme.render(README, readme.blocks()) == README


@pytest.mark.parametrize("cls", [BootstrapSettings, PrefillSettings, DecodeSettings])
def test_every_setting_is_documented(cls):
    prefix = cls.model_config["env_prefix"]
    for name in cls.model_fields:
        assert f"`{prefix}{name.upper()}`" in README, name
        assert f"`--{name.replace('_', '-')}`" in README, name


def test_ci_runs_the_readme_test_command():
    assert "bash run.sh" in README and "bash test.sh" in README
    assert "bash test.sh" in (ROOT / ".ci" / "run").read_text()


def test_failure_reasons_are_documented():
    from shared.states import FailureReason

    for reason in FailureReason:
        assert f"`{reason}`" in README, reason
