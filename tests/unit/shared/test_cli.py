"""Entry points read settings from flags: a bad value is one line naming its flag, and exit 2."""

import os

import pytest

from prefill_node.settings import PrefillSettings
from shared.cli import VERSION, parse_settings


@pytest.fixture(autouse=True)
def no_kvroom_environment(monkeypatch):
    """Settings come from the environment too: these tests see none of it."""
    for name in [n for n in os.environ if n.startswith("KVROOM_")]:
        monkeypatch.delenv(name)


def exit_code(argv: list[str]) -> int | str | None:
    with pytest.raises(SystemExit) as info:
        parse_settings(PrefillSettings, argv)
    return info.value.code


def test_an_out_of_range_port_is_one_line_naming_the_flag(capsys):
    assert exit_code(["--http-port", "99999"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and "--http-port" in lines[0]
    assert lines[0].startswith("python -m prefill_node: ")


def test_each_bad_setting_gets_its_line(capsys):
    assert exit_code(["--http-port", "0", "--zmq-port", "70000"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert "--http-port" in lines[0] and "--zmq-port" in lines[1]


def test_a_check_across_settings_is_one_line_too(capsys):
    assert exit_code(["--host", "0.0.0.0"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "--advertise-host" in lines[0]


def test_version_prints_and_exits_0(capsys):
    assert exit_code(["--http-port", "99999", "--version"]) == 0  # before any setting is checked
    out, err = capsys.readouterr()
    assert out.strip() == f"python -m prefill_node {VERSION}" and err == ""


def test_valid_flags_give_settings(capsys):
    settings = parse_settings(
        PrefillSettings, ["--http-port", "8200", "--zmq-security", "plain", "--tp-size", "2"]
    )
    assert isinstance(settings, PrefillSettings)
    assert (settings.http_port, settings.zmq_security, settings.tp_size) == (8200, "plain", 2)
    assert settings.zmq_port == 8101  # the default stays
    assert capsys.readouterr() == ("", "")


def test_the_environment_is_read_under_the_services_prefix(monkeypatch):
    monkeypatch.setenv("KVROOM_PREFILL_HTTP_PORT", "8300")
    assert parse_settings(PrefillSettings, []).http_port == 8300
    assert parse_settings(PrefillSettings, ["--http-port", "8400"]).http_port == 8400  # flags on top


def test_the_package_and_every_version_flag_share_one_version():
    from importlib.metadata import version

    assert version("kvroom") == VERSION
