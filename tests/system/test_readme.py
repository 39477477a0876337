"""The README is a front page with the two commands CI relies on; docs/ documents every setting
and failure reason, and its generated blocks are current."""

from pathlib import Path

import pytest

from bootstrap.settings import BootstrapSettings
from decode_node.settings import DecodeSettings
from launcher import readme
from prefill_node.settings import PrefillSettings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


@pytest.mark.parametrize("name", sorted(readme.PAGES))
def test_generated_blocks_are_current(name):
    """`python -m launcher.readme` rewrites them: run it after changing a setting or benchmarking."""
    text = readme.PAGES[name].read_text()
    assert f"<!-- {name}:start -->" in text and f"<!-- {name}:end -->" in text
    generated = readme.blocks()
    assert name in generated, "the benchmark has no results to show"
    assert readme.render(text, {name: generated[name]}) == text


@pytest.mark.parametrize("cls", [BootstrapSettings, PrefillSettings, DecodeSettings])
def test_every_setting_is_documented(cls):
    settings = (DOCS / "settings.md").read_text()
    prefix = cls.model_config["env_prefix"]
    for name in cls.model_fields:
        assert f"`{prefix}{name.upper()}`" in settings, name
        assert f"`--{name.replace('_', '-')}`" in settings, name


def test_the_front_page_links_every_page_of_the_docs():
    for page in DOCS.glob("*.md"):
        assert f"(docs/{page.name})" in README, page.name
    assert len(README.splitlines()) <= 200


def test_ci_runs_the_readme_test_command():
    assert "bash run.sh" in README and "bash test.sh" in README
    assert "bash test.sh" in (ROOT / ".ci" / "run").read_text()


def test_failure_reasons_are_documented():
    from shared.room.states import FailureReason

    failures = (DOCS / "failures.md").read_text()
    for reason in FailureReason:
        assert f"`{reason}`" in failures, reason
