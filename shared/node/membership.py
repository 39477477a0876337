"""The node as the bootstrap knows it: registration, heartbeats, reports, leaving.

Registration and heartbeats go over HTTP with the join secret (``Authorization:
Bearer``); reports and streamed tokens go over ZMQ, CURVE-authenticated, to
the report endpoint the bootstrap named. A refused registration (409) is retried
with a growing pause; an unreachable bootstrap gets heartbeats until it answers
(a restarted one that kept its store knows the node); one that forgot the node
(404) gets a new registration; a bootstrap that restarted (its id changed) gets every room the
node still knows reported again.
"""

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable
from typing import Any

import httpx

from shared.errors import RegistrationError
from shared.node.settings import NodeSettings
from shared.room.record import Room
from shared.wire import protocol
from shared.wire.registration import Heartbeat, NodeRegistration, Registered
from shared.wire.security import load_public_key

log = logging.getLogger(__name__)

# How long room state changes are gathered before they go to the bootstrap in one
# message: briefly for a room that ended, longer for progress, which no one waits on
# and which would otherwise wake the bootstrap in the middle of most KV writes. A room
# that finished (what a client waits for) goes at the end of the loop's turn, unless a
# message went less than REPORT_DELAY_S ago: then once that much has passed. A lone room
# waits for nothing; under load one message still carries many rooms.
REPORT_DELAY_S = 0.002
PROGRESS_REPORT_DELAY_S = 0.05
TOKEN_DELAY_S = 0.002
MAX_RETRY_S = 30.0
REFUSED = (401, 403, 409, 422)  # the bootstrap said no, as opposed to not answering

Send = Callable[[str, str, list[bytes]], bool]  # endpoint, its CURVE key, frames


class Standing(enum.StrEnum):
    STARTING = "starting"
    REGISTERED = "registered"
    REFUSED = "refused"
    UNREACHABLE = "unreachable"
    DRAINING = "draining"


class Membership:
    def __init__(
        self,
        settings: NodeSettings,
        node_id: str,
        registration: Callable[[], NodeRegistration],
        heartbeat: Callable[[], Heartbeat],
        send: Send,
        known_rooms: Callable[[], list[Room]],
        orphaned: Callable[[list[int]], None],
    ):
        self.settings = settings
        self.node_id = node_id
        self._registration = registration
        self._heartbeat = heartbeat
        self._send = send
        self._known_rooms = known_rooms
        self._orphaned = orphaned
        self.standing = Standing.STARTING
        self.problem: str | None = "not registered yet"
        self.registered = asyncio.Event()
        self._pinned = (
            load_public_key(settings.bootstrap_public_key) if settings.bootstrap_public_key else None
        )
        self.bootstrap_keys: frozenset[str] = frozenset()
        self._report_to: tuple[str, str, str] | None = None  # (bootstrap id, endpoint, key)
        self._epoch: str | None = None
        token = settings.resolved_join_token()
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._json = {**self.auth, "content-type": "application/json"}
        self._pending_reports: dict[int, Room] = {}
        self._report_due = float("inf")  # loop time of the next flush; inf when none is set
        self._flushed_at = float("-inf")  # loop time of the last flush
        self._report_timer: asyncio.Handle | None = None
        self._pending_tokens: list[protocol.TokenChunk] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._beat_now = asyncio.Event()

    def is_bootstrap(self, sender: str | None) -> bool:
        """Whether ``sender`` is a bootstrap of our cluster (anyone, with security off)."""
        return sender is None or sender in self.bootstrap_keys

    # -- reports ----------------------------------------------------------------------

    def report(self, room: Room) -> None:
        """Tell the bootstrap where the room stands on this node.

        Changes are gathered for a moment and sent as one message, the latest
        state of each room with the time it entered every state: under load
        the bootstrap handles a few messages instead of one per transition.
        """
        assert self.loop is not None
        self._pending_reports[room.id] = room
        now = self.loop.time()
        if room.finished:
            due = max(now, self._flushed_at + REPORT_DELAY_S)
        else:
            due = now + (REPORT_DELAY_S if room.state.terminal else PROGRESS_REPORT_DELAY_S)
        self._schedule(due)

    def tokens(self, room: int, offset: int, tokens: list[int]) -> None:
        assert self.loop is not None
        self._pending_tokens.append(protocol.TokenChunk(room, offset, tokens))
        self._schedule(self.loop.time() + TOKEN_DELAY_S)

    def _schedule(self, due: float) -> None:
        assert self.loop is not None
        if self._report_due <= due:
            return
        if self._report_timer is not None:
            self._report_timer.cancel()
        self._report_due = due
        self._report_timer = self.loop.call_at(due, self.flush)

    def flush(self) -> None:
        assert self.loop is not None
        self._report_due = float("inf")
        self._report_timer = None
        self._flushed_at = self.loop.time()
        if self._report_to is None:
            return  # kept until we know where reports go
        _, endpoint, key = self._report_to
        chunks, self._pending_tokens = self._pending_tokens, []
        for start in range(0, len(chunks), protocol.MAX_REPORTS):
            msg = protocol.RoomTokens(self.node_id, chunks[start : start + protocol.MAX_REPORTS])
            self._send(endpoint, key, protocol.encode(msg))
        rooms = list(self._pending_reports.values())
        self._pending_reports.clear()
        for start in range(0, len(rooms), protocol.MAX_REPORTS):
            statuses = [
                protocol.RoomStatus(
                    room=room.id,
                    state=int(room.state),
                    reason=room.reason,
                    timestamps=room.timestamps,
                    output_ids=room.output_ids,
                    timings=room.timings,
                    outcome=room.outcome,
                    finish_reason=room.finish_reason,
                )
                for room in rooms[start : start + protocol.MAX_REPORTS]
            ]
            self._send(endpoint, key, protocol.encode(protocol.RoomReports(self.node_id, statuses)))

    # -- the bootstrap ----------------------------------------------------------------

    def _accept(self, answer: dict[str, Any]) -> None:
        """Take the bootstrap's answer to a registration or heartbeat.

        Reports keep going to the same bootstrap while it lives (there may be
        several behind one address); when it is gone, or the cluster says
        reports may have been lost, every room this node knows is reported again.
        """
        registered = Registered.model_validate(answer)
        live = {b.id: b for b in registered.bootstraps}
        keys = frozenset(b.public_key for b in live.values() if b.public_key)
        if self._pinned is not None and self._pinned not in keys:
            raise RegistrationError(
                f"the bootstrap's keys {sorted(keys)} do not include the pinned one", refused=True
            )
        self.bootstrap_keys = frozenset({self._pinned}) if self._pinned else keys
        moved = self._report_to is not None and self._report_to[0] not in live
        if self._report_to is None or moved:
            target = registered.bootstraps[0]
            self._report_to = (target.id, target.report_endpoint, target.public_key)
        lost = self._epoch is not None and registered.epoch != self._epoch
        self._epoch = registered.epoch
        if moved or lost:
            rooms = self._known_rooms()
            log.warning("reports may have been lost; reporting %d rooms again", len(rooms))
            for room in rooms:
                self.report(room)
        if registered.unknown_rooms:
            log.warning(
                "the cluster does not hold %d rooms of this node: ending them", len(registered.unknown_rooms)
            )
            self._orphaned(registered.unknown_rooms)

    async def _register(self, client: httpx.AsyncClient) -> None:
        reg = self._registration()
        resp = await client.post("/nodes", content=reg.model_dump_json(), headers=self._json)
        if resp.status_code != 201:
            refused = resp.status_code in REFUSED
            raise RegistrationError(f"{resp.status_code} {_detail(resp)}", refused)
        self._accept(resp.json())
        self.standing, self.problem = Standing.REGISTERED, None
        self.registered.set()
        log.info(
            "registered with %s as %s (%d ranks)", self.settings.bootstrap_url, self.node_id, reg.tp_size
        )

    async def run(self) -> None:
        """Register, then heartbeat; register again whenever the bootstrap forgot us. Until cancelled.

        A draining node goes on beating, or the bootstrap would take it for dead while its last
        rooms run; it does not register again.
        """
        self.loop = asyncio.get_running_loop()
        s = self.settings
        retry = s.register_retry_s
        async with httpx.AsyncClient(base_url=s.bootstrap_url, timeout=5.0) as client:
            while True:
                draining = self.standing is Standing.DRAINING
                try:
                    if not self.registered.is_set():
                        if draining:
                            return
                        await self._register(client)
                    beat = self._heartbeat()
                    resp = await client.put(
                        f"/nodes/{self.node_id}/heartbeat", content=beat.model_dump_json(), headers=self._json
                    )
                    if resp.status_code == 404:
                        log.warning("the bootstrap does not know this node; registering again")
                        self.registered.clear()
                        continue
                    if resp.status_code != 200:
                        refused = resp.status_code in REFUSED
                        raise RegistrationError(f"heartbeat: {resp.status_code} {_detail(resp)}", refused)
                    self._accept(resp.json())
                    if not draining:
                        self.standing, self.problem = Standing.REGISTERED, None
                    retry = s.register_retry_s
                except (httpx.HTTPError, RegistrationError, ValueError) as exc:
                    if draining:  # it leaves soon, whatever the bootstrap says
                        log.warning("heartbeat while draining: %s", exc)
                        await asyncio.sleep(s.heartbeat_interval_s)
                        continue
                    refused = isinstance(exc, RegistrationError) and exc.refused
                    self.standing = Standing.REFUSED if refused else Standing.UNREACHABLE
                    self.problem = f"registration {self.standing}: {exc}"
                    if refused:
                        self.registered.clear()
                    log.warning("%s; trying again in %.1fs", self.problem, retry)
                    await asyncio.sleep(retry)
                    # A refusal backs off; a registered node that lost the bootstrap keeps trying
                    # within its heartbeat interval, so that a bootstrap restarting with its store
                    # hears from it before its lease is taken for dead (404 means register again).
                    cap = s.heartbeat_interval_s if self.registered.is_set() else MAX_RETRY_S
                    retry = min(cap, retry * 2)
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._beat_now.wait(), s.heartbeat_interval_s)
                self._beat_now.clear()

    def beat_now(self) -> None:
        """Send the next heartbeat at once: the node's health changed."""
        self._beat_now.set()

    async def leave(self, timeout_s: float = 5.0) -> None:
        """Drain: tell the bootstrap to place nothing more here. Reports keep flowing."""
        self.standing, self.problem = Standing.DRAINING, "draining"
        try:
            async with httpx.AsyncClient(base_url=self.settings.bootstrap_url, timeout=timeout_s) as client:
                resp = await client.post(f"/nodes/{self.node_id}/drain", headers=self.auth)
            log.info("told the bootstrap this node drains: %s", resp.status_code)
        except httpx.HTTPError as exc:
            log.warning("could not tell the bootstrap this node drains: %s", exc)


def _detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    detail = body.get("detail") if isinstance(body, dict) else body
    return str(detail)[:300]
