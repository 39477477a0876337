"""CURVE key files, public keys given as text or file, secrets from settings, and bearer tokens."""

import logging
from pathlib import Path

import pytest
import zmq

from shared.errors import SecretError
from shared.settings import read_secret
from shared.wire.security import (
    CurveKeys,
    Security,
    bearer,
    load_public_key,
    secrets_match,
    security_for,
    write_keys,
)


@pytest.fixture
def key_files(tmp_path: Path) -> tuple[Path, Path]:
    return write_keys(tmp_path / "keys", "node")


def is_pair(keys: CurveKeys) -> bool:
    return zmq.curve_public(keys.secret.encode()) == keys.public.encode()


def test_generated_keys_are_a_z85_pair():
    keys = CurveKeys.generate()
    assert len(keys.public) == len(keys.secret) == 40 and is_pair(keys)
    assert CurveKeys.generate() != keys


def test_written_keys_load_as_a_pair_and_the_secret_is_private(key_files):
    public, secret = key_files
    assert (public.name, secret.name) == ("node.key", "node.key_secret")
    assert secret.stat().st_mode & 0o077 == 0
    keys = CurveKeys.load(secret)
    assert is_pair(keys)
    assert load_public_key(str(public)) == keys.public


def test_the_public_file_is_refused_as_a_secret(key_files):
    public, _ = key_files
    with pytest.raises(SecretError, match="no secret key"):
        CurveKeys.load(public)


def test_a_missing_key_file_is_a_secret_error(tmp_path):
    with pytest.raises(SecretError):
        CurveKeys.load(tmp_path / "absent.key_secret")
    with pytest.raises(SecretError):
        load_public_key(str(tmp_path / "absent.key"))


def test_a_public_key_given_as_text():
    keys = CurveKeys.generate()
    assert load_public_key(keys.public) == keys.public
    with pytest.raises(SecretError):
        load_public_key(keys.public[:39])  # neither a key nor a file


def test_a_40_character_text_that_is_not_z85_is_a_secret_error():
    with pytest.raises(SecretError):
        load_public_key('"' * 40)


def test_read_secret_from_a_value_or_a_file(tmp_path):
    assert read_secret("direct", None, "join token") == "direct"
    assert read_secret(None, None, "join token") is None
    assert read_secret("", None, "join token") is None
    path = tmp_path / "token"
    path.write_text("  from-file \n")
    assert read_secret("direct", path, "join token") == "from-file"  # the file wins, stripped


def test_a_secret_file_gives_its_first_line(tmp_path):
    path = tmp_path / "token"
    path.write_text("first\nsecond\n")
    assert read_secret(None, path, "join token") == "first"


def test_an_empty_or_missing_secret_file_is_an_error(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    with pytest.raises(SecretError, match=r"API key file .* is empty"):
        read_secret(None, empty, "API key")
    with pytest.raises(SecretError, match="cannot read the API key file"):
        read_secret(None, tmp_path / "absent", "API key")


def test_secrets_match():
    assert secrets_match("s3cret", "s3cret")
    assert not secrets_match("s3cret ", "s3cret")
    assert not secrets_match("other", "s3cret")
    assert not secrets_match(None, "s3cret")
    assert not secrets_match("", "s3cret")


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer x", "x"),
        ("bearer x", "x"),
        ("BEARER  tok ", "tok"),
        ("Basic x", None),
        ("Bearerx", None),
        (None, None),
    ],
)
def test_bearer_tokens(header, token):
    assert bearer(header) == token


def test_plain_security_is_no_security(caplog):
    with caplog.at_level(logging.WARNING, logger="shared.wire.security"):
        plain = security_for("plain", None)
    assert plain == Security(None) and plain.public_key == ""
    assert "OFF" in caplog.text
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    try:
        plain.server(sock)
        plain.client(sock, "")
        assert not sock.curve_server and sock.mechanism == zmq.NULL
    finally:
        sock.close(0)
        ctx.term()


def test_curve_security_from_a_file_or_made_at_start(key_files):
    _, secret = key_files
    assert security_for("curve", secret).keys == CurveKeys.load(secret)
    made = security_for("curve", None)
    assert made.keys is not None and is_pair(made.keys) and made.public_key == made.keys.public


def test_curve_sockets_are_made_servers_and_clients():
    keys, server = CurveKeys.generate(), CurveKeys.generate()
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        Security(server).server(a)
        assert a.curve_server and a.mechanism == zmq.CURVE
        Security(keys).client(b, server.public)
        assert not b.curve_server and b.mechanism == zmq.CURVE  # keys are checked by test_zmq_io's handshake
        with pytest.raises(SecretError):
            Security(keys).client(b, "")  # a peer that gave no key cannot be reached securely
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
