"""Rooms on vLLM nodes: each attempt is two requests to the nodes' OpenAI servers, sent at once.

A vLLM server with kvroom's connector takes a room as a completion request whose
``kv_transfer_params`` name the transfer, the node's role and the peer node's ranks. The prefill
request computes the prompt's KV and sends it; the decode request waits for it, then streams the
tokens. Where the transfer stands comes only from the nodes' own reports (``bootstrap.reports``),
as for kvroom's nodes: once the decode's response is complete the room ends completed only when
its decode node has reported SUCCESS. A request that cannot be made, is cut, or is refused fails
the attempt. Cancelling an attempt (``cancel``) closes its connections, which makes vLLM abort
both requests.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import msgspec

from bootstrap import rooms
from bootstrap.registry import Node
from bootstrap.settings import BootstrapSettings
from bootstrap.store import RoomData, Store
from bootstrap.tasks import Tasks
from bootstrap.waiters import Waiters
from shared.errors import KvroomError
from shared.room.record import TransferId
from shared.room.states import FailureReason, RoomState
from shared.wire import grants
from shared.wire.protocol import RoomId

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0
# Two connections a room in flight; beyond, a request waits for one (up to its timeout).
MAX_CONNECTIONS = 1024
# The decode's response is complete: its SUCCESS report may still be on its way over ZMQ.
SUCCESS_WAIT_S = 10.0
# A request failed: its node's report of why may still be on its way over ZMQ.
REPORTED_FAILURE_WAIT_S = 2.0
FINISH_REASONS = ("stop", "length")

# lifecycle.fail for one attempt: (room, reason, the attempt's transfer).
FailAttempt = Callable[[RoomId, str, TransferId], Awaitable[object]]
Finished = Callable[[RoomData], Awaitable[None]]


class AttemptFailed(KvroomError):
    """A request of the attempt failed: ``reason`` is the room's, ``detail`` says what happened."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def transfer_params(
    room: RoomData, transfer: TransferId, role: str, node: Node, peer: Node, key: bytes, ttl_s: float
) -> dict[str, Any]:
    """What kvroom's connector in vLLM reads from a request to ``node``: the transfer and the peer
    node's ranks, signed with the cluster's key (the connector acts on nothing else), good for
    ``ttl_s``."""
    grant = grants.TransferGrant(
        transfer=transfer,
        role=role,  # type: ignore[arg-type]
        node=node.id,
        peer_node=peer.id,
        peers=peer.peers,
        prompt_len=len(room.input_ids),
        prompt_digest=grants.prompt_digest(room.input_ids),
        expires=time.time() + ttl_s,
    )
    return {"kvroom": msgspec.to_builtins(grants.sign(grant, key))}


def prefill_request(
    room: RoomData, transfer: TransferId, prefill: Node, decode: Node, key: bytes, ttl_s: float
) -> dict[str, Any]:
    return {
        "model": prefill.reg.model.name,
        "prompt": room.input_ids,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": transfer_params(room, transfer, "prefill", prefill, decode, key, ttl_s),
    }


def decode_request(
    room: RoomData, transfer: TransferId, prefill: Node, decode: Node, key: bytes, ttl_s: float
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": decode.reg.model.name,
        "prompt": room.input_ids,
        "max_tokens": room.max_new_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        "kv_transfer_params": transfer_params(room, transfer, "decode", decode, prefill, key, ttl_s),
    }
    if room.stop:
        # The stop string stays in the output, as a kvroom decode's does: the API cuts the text.
        body |= {"stop": room.stop, "include_stop_str_in_output": True}
    return body


def _event(line: str) -> dict[str, Any] | None:
    """The JSON of one server-sent event line; None for anything else (blank lines, ``[DONE]``)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    event = msgspec.json.decode(data)
    if not isinstance(event, dict):
        raise msgspec.DecodeError("an event that is not an object")
    return event


class VllmDriver:
    """The attempts in flight on vLLM nodes, one task each, keyed by transfer."""

    def __init__(
        self,
        settings: BootstrapSettings,
        store: Store,
        waiters: Waiters,
        tasks: Tasks,
        fail: FailAttempt,
        finished: Finished,
    ):
        self._store = store
        # A request that is still queued when its attempt gave up would be served for nothing.
        self._grant_ttl_s = settings.request_timeout_s
        self._waiters = waiters
        self._tasks = tasks
        self._fail = fail
        self._finished = finished
        self._attempts: dict[TransferId, asyncio.Future[Any]] = {}
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.request_timeout_s, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS),
            trust_env=False,  # the nodes are members of the cluster, never behind a proxy
        )

    def start(self, room: RoomData, prefill: Node, decode: Node) -> None:
        transfer = room.attempt.transfer
        self._attempts[transfer] = self._tasks.spawn(self._drive(room, transfer, prefill, decode))

    def cancel(self, transfer: TransferId) -> None:
        """End the attempt's requests, if it still has any: vLLM aborts a request whose client left."""
        task = self._attempts.pop(transfer, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks = list(self._attempts.values())
        for transfer in list(self._attempts):
            self.cancel(transfer)
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.aclose()

    async def _drive(self, room: RoomData, transfer: TransferId, prefill: Node, decode: Node) -> None:
        failure: AttemptFailed | None = None
        try:
            async with asyncio.TaskGroup() as group:
                # Both at once: the decode's connector waits for the KV the prefill's sends.
                group.create_task(self._prefill(room, transfer, prefill, decode))
                decoded = group.create_task(self._decode(room, transfer, prefill, decode))
        except* AttemptFailed as errors:
            first = errors.exceptions[0]
            assert isinstance(first, AttemptFailed)  # each request raises it alone, never a group
            failure = first
        finally:
            # From here on, ending the attempt (which cancels it) must not cancel this task.
            self._attempts.pop(transfer, None)
        if failure is not None:
            log.warning(
                "room=%d transfer=%d failed: %s", room.room, transfer, failure, extra={"room": room.room}
            )
            if failure.reason != FailureReason.PEER_LOST:
                # A vLLM request fails when its connector failed the transfer: that node's report,
                # with the reason why, may still be on its way.
                await self._waiters.wait(
                    self._store,
                    room.room,
                    REPORTED_FAILURE_WAIT_S,
                    lambda r: r.done or r.attempt.transfer != transfer,
                )
            await self._fail(room.room, failure.reason, transfer)
            return
        output, finish_reason = decoded.result()
        await self._complete(room, transfer, output, finish_reason)

    async def _prefill(self, room: RoomData, transfer: TransferId, prefill: Node, decode: Node) -> None:
        key = await self._store.params_key()
        body = prefill_request(room, transfer, prefill, decode, key, self._grant_ttl_s)
        try:
            response = await self._client.post(_completions(prefill), json=body)
        except httpx.TransportError as exc:
            raise AttemptFailed(FailureReason.PEER_LOST, f"prefill node {prefill.id}: {exc!r}") from exc
        if response.is_error:
            raise AttemptFailed(
                FailureReason.PREFILL_FAILED,
                f"prefill node {prefill.id} answered {response.status_code}: {response.text[:200]}",
            )

    async def _decode(
        self, room: RoomData, transfer: TransferId, prefill: Node, decode: Node
    ) -> tuple[list[int], str]:
        """Every token the decode returned, and why it stopped."""
        key = await self._store.params_key()
        body = decode_request(room, transfer, prefill, decode, key, self._grant_ttl_s)
        output: list[int] = []
        published = 0
        finish_reason = None
        try:
            async with self._client.stream("POST", _completions(decode), json=body) as response:
                if response.is_error:
                    await response.aread()
                    raise AttemptFailed(
                        FailureReason.DECODE_FAILED,
                        f"decode node {decode.id} answered {response.status_code}: {response.text[:200]}",
                    )
                async for line in response.aiter_lines():
                    event = _event(line)
                    if event is None:
                        continue
                    if "error" in event:
                        raise AttemptFailed(
                            FailureReason.DECODE_FAILED,
                            f"decode node {decode.id} failed mid-stream: {event['error']}",
                        )
                    for choice in event.get("choices", []):
                        output += choice.get("token_ids") or []
                        finish_reason = choice.get("finish_reason") or finish_reason
                    if room.stream and len(output) > published:
                        published = await self._publish(room.room, transfer, output, published)
        except httpx.TransportError as exc:  # refused, timed out, or cut
            raise AttemptFailed(FailureReason.PEER_LOST, f"decode node {decode.id}: {exc!r}") from exc
        except msgspec.DecodeError as exc:
            raise AttemptFailed(
                FailureReason.DECODE_FAILED,
                f"decode node {decode.id} sent an invalid event: {exc}",
            ) from exc
        if finish_reason is None:
            raise AttemptFailed(FailureReason.PEER_LOST, f"decode node {decode.id} ended its stream early")
        if finish_reason not in FINISH_REASONS:
            raise AttemptFailed(
                FailureReason.DECODE_FAILED,
                f"decode node {decode.id} finished {finish_reason}",
            )
        return output, finish_reason

    async def _success(self, room_id: RoomId, transfer: TransferId) -> RoomData | None:
        """The room once the decode node's report made it SUCCESS, it ended or it was placed again
        (or as it is after SUCCESS_WAIT_S)."""
        return await self._waiters.wait(
            self._store,
            room_id,
            SUCCESS_WAIT_S,
            lambda r: r.done or r.attempt.transfer != transfer or r.state == RoomState.SUCCESS,
        )

    async def _publish(self, room_id: RoomId, transfer: TransferId, output: list[int], published: int) -> int:
        """Stream the tokens not yet streamed, once the room is SUCCESS: no token goes out before its
        KV is known to have landed. The first tokens may come before the decode node's report of
        SUCCESS (a separate path): they wait for it here, so they go out as it lands rather than
        with the next token. Returns how many have been streamed."""
        if published == 0:
            room = await self._success(room_id, transfer)
            if room is None or not _succeeded(room, transfer):
                return 0
        await self._store.add_tokens(room_id, published, output[published:])
        return len(output)

    async def _complete(
        self, room: RoomData, transfer: TransferId, output: list[int], finish_reason: str
    ) -> None:
        """End the room completed, once its decode node's report made it SUCCESS."""
        now = await self._success(room.room, transfer)
        if now is None or now.done or now.attempt.transfer != transfer:
            return  # ended, or placed again, meanwhile
        if now.state != RoomState.SUCCESS:
            log.warning(
                "room=%d transfer=%d: the decode answered, but never reported SUCCESS",
                room.room,
                transfer,
                extra={"room": room.room},
            )
            await self._fail(room.room, FailureReason.TRANSFER_TIMEOUT, transfer)
            return
        if room.stream:  # the rest of the tokens, as a kvroom decode streams all of them
            streamed = len(await self._store.tokens(room.room))
            if len(output) > streamed:
                await self._store.add_tokens(room.room, streamed, output[streamed:])
        completed = False

        def change(r: RoomData) -> bool:
            nonlocal completed
            completed = _succeeded(r, transfer) and not r.done
            if completed:
                rooms.complete(r, output, finish_reason)
            return completed

        ended = await self._store.update_room(room.room, change)
        if ended is not None and completed:
            await self._finished(ended)


def _completions(node: Node) -> str:
    return f"{node.reg.http_url.rstrip('/')}/v1/completions"


def _succeeded(room: RoomData, transfer: TransferId) -> bool:
    return room.attempt.transfer == transfer and room.state == RoomState.SUCCESS
