"""Transfer parameters a vLLM server acts on only when the bootstrap issued them.

A vLLM server's OpenAI port is open to clients, and a request's ``kv_transfer_params`` would
otherwise tell the connector which transfer to serve and which peer ranks to read from or write
to. So the bootstrap signs each placement it hands a server (a ``TransferGrant``): the transfer,
the server and its side, the peer node and its ranks, the prompt's tokens and an expiry, under an
HMAC-SHA256 key of the cluster that each server gets in the answers to its authenticated
registration and heartbeats (``Registered.params_key``; a vLLM API server asks for it at
``GET /params-key`` with the join token). A grant is good for one request: a server that has
seen its transfer refuses it again (``FirstUse``). The expiry is the bootstrap's clock: the
servers' clocks must agree with it to well within the bootstrap's ``request_timeout_s``.

Whoever holds the cluster's join token can get the key: the nodes, which are members anyway;
never a client of the OpenAI port.
"""

import array
import hashlib
import hmac
import sys
import time
from typing import Annotated, Literal

import msgspec

from shared.wire import protocol

DOMAIN = b"kvroom transfer grant v1\0"  # a MAC over a grant is never valid for anything else
KEY_BYTES = 32


class TransferGrant(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One placement of a room on one vLLM server, as the bootstrap signed it."""

    transfer: protocol.Transfer
    role: Literal["prefill", "decode"]
    node: protocol.Text  # the server it is for: a grant taken elsewhere is no good
    peer_node: protocol.Text
    peers: Annotated[list[protocol.PeerRank], msgspec.Meta(min_length=1, max_length=protocol.MAX_RANKS)]
    prompt_len: Annotated[int, msgspec.Meta(ge=1, le=protocol.MAX_TOKENS)]
    prompt_digest: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]  # prompt_digest() of its tokens
    expires: float  # seconds since the epoch, the bootstrap's clock
    signature: Annotated[str, msgspec.Meta(pattern=r"^([0-9a-f]{64})?$")] = ""


def prompt_digest(tokens: list[int]) -> str:
    """SHA-256 of the prompt's token ids: a grant is for this prompt, not any of its length."""
    try:
        ids = array.array("q", tokens)
    except (OverflowError, TypeError):
        return ""  # no token id: no grant's
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.sha256(ids.tobytes()).hexdigest()


def _mac(grant: TransferGrant, key: bytes) -> str:
    body = msgspec.json.encode(msgspec.structs.replace(grant, signature=""))
    return hmac.new(key, DOMAIN + body, hashlib.sha256).hexdigest()


def sign(grant: TransferGrant, key: bytes) -> TransferGrant:
    return msgspec.structs.replace(grant, signature=_mac(grant, key))


def refusal(
    grant: TransferGrant,
    key: bytes | None,
    role: str,
    prompt: list[int] | None,
    node: str | None = None,
    now: float | None = None,
) -> str | None:
    """Why server ``node`` (None: not known here) of ``role`` must not act on the grant for a prompt
    of these tokens (None: not known yet), or None when it may."""
    if key is None:
        return "this server has no key to check transfer parameters with yet (not registered)"
    if not hmac.compare_digest(grant.signature, _mac(grant, key)):
        return "transfer parameters not signed by the cluster's bootstrap"
    if grant.role != role:
        return f"transfer parameters for a {grant.role} server, sent to a {role} server"
    if node is not None and grant.node != node:
        return f"transfer parameters for node {grant.node}, sent to {node}"
    if prompt is not None and (
        len(prompt) != grant.prompt_len or prompt_digest(prompt) != grant.prompt_digest
    ):
        return f"transfer parameters for another prompt ({grant.prompt_len} tokens; this one: {len(prompt)})"
    if (time.time() if now is None else now) > grant.expires:
        return "transfer parameters expired"
    return None


class FirstUse:
    """The transfers this server has taken a request for, until their grants expire: a grant names
    one request, and a second request with it is a replay."""

    def __init__(self) -> None:
        self._users: dict[protocol.TransferId, tuple[str, float]] = {}

    def take(self, grant: TransferGrant, user: str, now: float) -> bool:
        """True if ``user`` (a request id) is the grant's first user, or is that user again. ``now``
        is the time ``refusal`` was asked at (an expired grant never gets here)."""
        # Grants expire in about the order they were issued: the oldest go first.
        while self._users and next(iter(self._users.values()))[1] < now:
            del self._users[next(iter(self._users))]
        first = self._users.setdefault(grant.transfer, (user, grant.expires))
        return first[0] == user
