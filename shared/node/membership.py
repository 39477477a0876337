"""The node as the bootstrap knows it: registration, heartbeats, leaving.

Registration and heartbeats go over HTTP with the join secret (``Authorization:
Bearer``); what the bootstrap answers says where reports go (``BootstrapLink``).
A refused registration (409) is retried with a growing pause; an unreachable
bootstrap gets heartbeats until it answers (a restarted one that kept its store
knows the node); one that forgot the node (404) gets a new registration; a
bootstrap that restarted (its id changed) gets every room the node still knows
reported again.
"""

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable
from typing import Any

import httpx

from shared.errors import RegistrationError
from shared.node.reports import BootstrapLink
from shared.node.settings import NodeSettings
from shared.room.record import Room
from shared.wire import protocol
from shared.wire.registration import Heartbeat, NodeRegistration, Registered
from shared.wire.security import load_public_key

log = logging.getLogger(__name__)

MAX_RETRY_S = 30.0
REFUSED = (401, 403, 409, 422)  # the bootstrap said no, as opposed to not answering


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
        link: BootstrapLink,
        registration: Callable[[], NodeRegistration],
        heartbeat: Callable[[], Heartbeat],
        known_rooms: Callable[[], list[Room]],
        orphaned: Callable[[list[protocol.TransferId]], None],
        writers_gone: Callable[[list[protocol.TransferId]], None] | None = None,
    ):
        self.settings = settings
        self.node_id = node_id
        self.link = link
        self._registration = registration
        self._heartbeat = heartbeat
        self._known_rooms = known_rooms
        self._orphaned = orphaned
        self._writers_gone = writers_gone  # a vLLM server's; a native node hears it in AbortRoom
        self.standing = Standing.STARTING
        self.problem: str | None = "not registered yet"
        self.registered = asyncio.Event()
        self._pinned = (
            load_public_key(settings.bootstrap_public_key) if settings.bootstrap_public_key else None
        )
        self._epoch: str | None = None
        # The cluster's key for transfer parameters (a vLLM server checks each request's with it).
        self.params_key: bytes | None = None
        token = settings.resolved_join_token()
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._json = {**self.auth, "content-type": "application/json"}
        self._beat_now = asyncio.Event()

    # -- the bootstrap ----------------------------------------------------------------

    def _accept(self, answer: dict[str, Any]) -> None:
        """Take the bootstrap's answer to a registration or heartbeat.

        Reports keep going to the same bootstrap while it lives (there may be
        several behind one address); when it is gone, or the cluster says
        reports may have been lost, every room this node knows is reported again.
        """
        registered = Registered.model_validate(answer)
        if registered.params_key:
            self.params_key = bytes.fromhex(registered.params_key)
        live = {b.id: b for b in registered.bootstraps}
        keys = frozenset(b.public_key for b in live.values() if b.public_key)
        if self._pinned is not None and self._pinned not in keys:
            raise RegistrationError(
                f"the bootstrap's keys {sorted(keys)} do not include the pinned one", refused=True
            )
        self.link.trust(frozenset({self._pinned}) if self._pinned else keys)
        moved = self.link.reporting_to is not None and self.link.reporting_to not in live
        if self.link.reporting_to is None or moved:
            self.link.report_to(registered.bootstraps[0])
        lost = self._epoch is not None and registered.epoch != self._epoch
        self._epoch = registered.epoch
        if moved or lost:
            rooms = self._known_rooms()
            log.warning("reports may have been lost; reporting %d rooms again", len(rooms))
            for room in rooms:
                self.link.report(room)
        if registered.unknown_transfers:
            log.warning(
                "the cluster does not hold %d rooms of this node: ending them",
                len(registered.unknown_transfers),
            )
            self._orphaned(registered.unknown_transfers)
        if registered.writers_gone and self._writers_gone is not None:
            self._writers_gone(registered.writers_gone)

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
                    if self.standing is not Standing.DRAINING:  # it may have begun during the beat
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

    def leaving(self) -> None:
        """The node is about to leave the cluster: a bootstrap that no longer knows it then ends
        the heartbeats, rather than taking a new registration (the node would be listed again)."""
        self.standing, self.problem = Standing.DRAINING, "leaving"

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
