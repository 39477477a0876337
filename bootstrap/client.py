"""A small command-line client for the bootstrap's REST API.

python -m bootstrap.client [--url URL] submit --prompt TEXT [--max-new-tokens N] [--wait S]
python -m bootstrap.client wait ROOM [--timeout S]
python -m bootstrap.client rooms [--state STATE] [--limit N]
python -m bootstrap.client nodes
python -m bootstrap.client abort ROOM
"""

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

ROOM_COLUMNS = ("room", "state", "reason", "prefill", "decode", "prompt", "out", "text")
NODE_COLUMNS = ("node", "role", "alive", "ranks", "rooms", "free pages", "heartbeat s")


def table(headers: Sequence[str], rows: list[Sequence[Any]]) -> str:
    cells = [[("" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def room_row(r: dict[str, Any]) -> list[Any]:
    text = r["text"]
    if text and len(text) > 40:
        text = text[:37] + "..."
    return [
        r["room"],
        r["state"],
        r["reason"],
        r["prefill"]["node_id"],
        r["decode"]["node_id"],
        r["prompt_tokens"],
        len(r["output_ids"] or []),
        text,
    ]


def wait_room(client: httpx.Client, room: int, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        left = max(0.0, deadline - time.monotonic())
        body: dict[str, Any] = check(client.get(f"/rooms/{room}", params={"wait": min(left, 30)}))
        if body["finished"] or left <= 0:
            return body


def check(resp: httpx.Response) -> Any:
    if resp.is_error:
        try:
            detail = resp.json().get("detail")
        except ValueError:
            detail = resp.text
        raise SystemExit(f"error {resp.status_code}: {detail}")
    return resp.json()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bootstrap.client", description="kvroom client")
    parser.add_argument(
        "--url",
        default=os.environ.get("KVROOM_URL", "http://127.0.0.1:8000"),
        help="bootstrap URL (env KVROOM_URL)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    submit = sub.add_parser("submit", help="create a room")
    given = submit.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt")
    given.add_argument("--input-ids", help="comma-separated token ids")
    submit.add_argument("--max-new-tokens", type=int, default=16)
    submit.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the room to finish")
    wait = sub.add_parser("wait", help="wait for a room to finish")
    wait.add_argument("room", type=int)
    wait.add_argument("--timeout", type=float, default=60.0)
    rooms = sub.add_parser("rooms", help="list rooms, newest first")
    rooms.add_argument("--state")
    rooms.add_argument("--limit", type=int, default=20)
    sub.add_parser("nodes", help="list nodes")
    abort = sub.add_parser("abort", help="abort a room")
    abort.add_argument("room", type=int)
    args = parser.parse_args(argv)

    try:
        with httpx.Client(base_url=args.url, timeout=90.0) as client:
            if args.command == "submit":
                body: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}
                if args.prompt is not None:
                    body["prompt"] = args.prompt
                else:
                    body["input_ids"] = [int(t) for t in args.input_ids.split(",")]
                room = check(client.post("/rooms", json=body))
                if args.wait:
                    room = wait_room(client, room["room"], args.wait)
                print(table(ROOM_COLUMNS, [room_row(room)]))
                return 0 if room["state"] != "FAILED" else 1
            if args.command == "wait":
                room = wait_room(client, args.room, args.timeout)
                print(table(ROOM_COLUMNS, [room_row(room)]))
                return 0 if room["state"] == "SUCCESS" else 1
            if args.command == "rooms":
                params: dict[str, Any] = {"limit": args.limit}
                if args.state:
                    params["state"] = args.state
                print(table(ROOM_COLUMNS, [room_row(r) for r in check(client.get("/rooms", params=params))]))
                return 0
            if args.command == "nodes":
                nodes = check(client.get("/nodes"))
                print(
                    table(
                        NODE_COLUMNS,
                        [
                            [
                                n["node_id"],
                                n["role"],
                                n["alive"],
                                len(n["ranks"]),
                                n["rooms_in_flight"],
                                f"{n['free_pages']}/{n['num_pages']}",
                                n["seconds_since_heartbeat"],
                            ]
                            for n in nodes
                        ],
                    )
                )
                return 0
            room = check(client.delete(f"/rooms/{args.room}"))
            print(table(ROOM_COLUMNS, [room_row(room)]))
            return 0
    except httpx.HTTPError as exc:
        raise SystemExit(f"cannot reach the bootstrap at {args.url}: {exc}") from exc


if __name__ == "__main__":
    sys.exit(main())
