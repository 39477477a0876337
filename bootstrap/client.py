"""A small command-line client for the bootstrap's REST API.

python -m bootstrap.client [--url URL] [--api-key KEY] submit (--prompt TEXT | --input-ids IDS)
                           [--max-new-tokens N] [--wait SECONDS] [--json]
python -m bootstrap.client wait ROOM [--timeout SECONDS] [--json]
python -m bootstrap.client rooms [--state STATE] [--limit N] [--json]
python -m bootstrap.client nodes [--json]
python -m bootstrap.client abort ROOM [--json]

Exit status: 0 done, 1 the bootstrap refused or could not be reached (or the room
failed), 2 a bad argument refused here. Errors are one line on stderr.
"""

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import httpx

from shared.cli import VERSION
from shared.errors import KvroomError

PROG = "python -m bootstrap.client"
ROOM_COLUMNS = ("room", "state", "outcome", "reason", "prefill", "decode", "prompt", "out", "text")
NODE_COLUMNS = ("node", "role", "tp", "alive", "health", "draining", "rooms", "free pages", "heartbeat s")


class ClientError(KvroomError):
    """The bootstrap refused a request or could not be reached; the message is one line."""


class Parser(argparse.ArgumentParser):
    """argparse, with its error in one line (subcommands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {one_line(message)} (see --help)\n")


def one_line(text: object, limit: int = 300) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def printable(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def room_id(text: str) -> int:
    try:
        room = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a room id is an integer, not {text!r}") from None
    if room < 0:
        raise argparse.ArgumentTypeError(f"a room id is not negative: {text!r}")
    return room


def token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, not {text!r}") from None


def bootstrap_url(text: str) -> str:
    try:
        url = httpx.URL(text)
    except httpx.InvalidURL as exc:
        raise argparse.ArgumentTypeError(f"not a URL: {text!r} ({exc})") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, not {text!r}")
    return text


def table(headers: Sequence[str], rows: list[Sequence[Any]]) -> str:
    cells = [[("" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def clip(text: str | None, width: int) -> str | None:
    if text is None:
        return None
    text = printable(text)
    return text if len(text) <= width else text[: width - 3] + "..."


def yes(flag: object) -> str:
    return "yes" if flag else "no"


def room_row(r: dict[str, Any]) -> list[Any]:
    return [
        r["room"],
        r["state"],
        r.get("outcome"),
        r["reason"],
        r["prefill"]["node_id"],
        r["decode"]["node_id"],
        r["prompt_tokens"],
        len(r["output_ids"] or []),
        clip(r["text"], 32),
    ]


def node_row(n: dict[str, Any]) -> list[Any]:
    health = "ok" if n["healthy"] else clip(n["problem"] or "unhealthy", 40)
    free = "-" if n["free_pages"] is None else n["free_pages"]
    return [
        n["node_id"],
        n["role"],
        n["tp_size"],
        yes(n["alive"]),
        health,
        yes(n["draining"]),
        n["rooms_in_flight"],
        f"{free}/{n['num_pages']}",
        n["seconds_since_heartbeat"],
    ]


def error_line(resp: httpx.Response) -> str:
    """``error STATUS: what`` from FastAPI's ``detail`` (text or validation list) or OpenAI's ``error``."""
    try:
        body = resp.json()
    except ValueError:
        body = resp.text.strip() or resp.reason_phrase
    detail = body.get("detail", body.get("error", body)) if isinstance(body, dict) else body
    if isinstance(detail, dict) and "message" in detail:
        detail = detail["message"]
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, dict):
                loc = [str(p) for p in item.get("loc", [])]
                where = ".".join(loc[1:] if loc[:1] in (["body"], ["query"], ["path"], ["header"]) else loc)
                parts.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
            else:
                parts.append(str(item))
        detail = "; ".join(parts)
    return f"error {resp.status_code}: {one_line(detail)}"


def check(resp: httpx.Response) -> Any:
    if resp.is_error:
        raise ClientError(error_line(resp))
    try:
        return resp.json()
    except ValueError:
        raise ClientError(f"error {resp.status_code}: the answer is not JSON") from None


def wait_room(client: httpx.Client, room: int, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        left = max(0.0, deadline - time.monotonic())
        body: dict[str, Any] = check(client.get(f"/rooms/{room}", params={"wait": min(left, 30)}))
        if body["finished"] or left <= 0:
            return body


def build_parser() -> Parser:
    parser = Parser(prog=PROG, description="kvroom client: submit, follow and list rooms; list nodes")
    parser.add_argument("--version", action="version", version=f"{PROG} {VERSION}")
    parser.add_argument(
        "--url",
        type=bootstrap_url,
        default=os.environ.get("KVROOM_URL", "http://127.0.0.1:8000"),
        help="bootstrap URL (env KVROOM_URL; default http://127.0.0.1:8000)",
    )
    parser.add_argument(
        "--api-key", metavar="KEY", help="sent as Authorization: Bearer (env KVROOM_API_KEY, preferred)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, what: str) -> Parser:
        cmd: Parser = sub.add_parser(name, help=what, description=what)
        cmd.add_argument("--json", action="store_true", help="print the JSON answer instead of a table")
        return cmd

    submit = command("submit", "create a room")
    given = submit.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", metavar="TEXT", help="text, tokenized by the bootstrap")
    given.add_argument("--input-ids", metavar="IDS", type=token_ids, help="comma-separated token ids")
    submit.add_argument("--max-new-tokens", metavar="N", type=int, default=16, help="default 16")
    submit.add_argument("--wait", metavar="SECONDS", type=float, default=0.0, help="wait for it to finish")
    wait = command("wait", "wait for a room to finish; exit 0 if it succeeded")
    wait.add_argument("room", metavar="ROOM", type=room_id)
    wait.add_argument("--timeout", metavar="SECONDS", type=float, default=60.0, help="default 60")
    rooms = command("rooms", "list rooms, newest first")
    rooms.add_argument("--state", metavar="STATE", help="only rooms in STATE (SUCCESS, FAILED, ...)")
    rooms.add_argument("--limit", metavar="N", type=int, default=20, help="default 20")
    command("nodes", "list nodes")
    abort = command("abort", "abort a room (it ends FAILED, reason aborted)")
    abort.add_argument("room", metavar="ROOM", type=room_id)
    return parser


def run(args: argparse.Namespace, client: httpx.Client) -> int:
    """One command; returns the exit status."""
    body: Any
    if args.command == "submit":
        request: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}
        if args.prompt is not None:
            request["prompt"] = args.prompt
        else:
            request["input_ids"] = args.input_ids
        body = check(client.post("/rooms", json=request))
        if args.wait:
            body = wait_room(client, body["room"], args.wait)
        status = 0 if body["state"] != "FAILED" else 1
    elif args.command == "wait":
        body = wait_room(client, args.room, args.timeout)
        if not body["finished"]:
            print(f"room {args.room} did not finish within {args.timeout:g} s", file=sys.stderr)
        status = 0 if body["state"] == "SUCCESS" else 1
    elif args.command == "rooms":
        params: dict[str, Any] = {"limit": args.limit}
        if args.state:
            params["state"] = args.state
        body, status = check(client.get("/rooms", params=params)), 0
    elif args.command == "nodes":
        body, status = check(client.get("/nodes")), 0
    else:
        body, status = check(client.delete(f"/rooms/{args.room}")), 0
    if args.json:
        print(json.dumps(body, indent=2))
    elif args.command == "nodes":
        print(table(NODE_COLUMNS, [node_row(n) for n in body]))
    else:
        print(table(ROOM_COLUMNS, [room_row(r) for r in (body if args.command == "rooms" else [body])]))
    return status


def main(argv: list[str] | None = None, transport: httpx.BaseTransport | None = None) -> int:
    """Run the client; ``transport`` replaces the network (tests)."""
    args = build_parser().parse_args(argv)
    key = args.api_key or os.environ.get("KVROOM_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(base_url=args.url, headers=headers, timeout=90.0, transport=transport) as client:
            return run(args, client)
    except httpx.HTTPError as exc:
        error = f"cannot reach the bootstrap at {args.url}: {one_line(exc) or type(exc).__name__}"
    except ClientError as exc:
        error = str(exc)
    except KeyboardInterrupt:
        return 130
    print(f"{PROG}: {error}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
