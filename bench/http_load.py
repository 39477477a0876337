"""A minimal keep-alive HTTP/1.1 client on asyncio streams, for load generation.

General-purpose clients spend milliseconds of CPU per request at high
concurrency, which on a small machine measures the client, not the service.
One connection per concurrent worker, JSON in and out, nothing more.
"""

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self._reader = reader
        self._writer = writer
        self._host = host

    @classmethod
    async def open(cls, url: str) -> "Connection":
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        return cls(reader, writer, parts.netloc)

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        payload = b"" if body is None else json.dumps(body).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self._host}\r\nContent-Length: {len(payload)}\r\n"
            "Content-Type: application/json\r\n\r\n"
        ).encode()
        self._writer.write(head + payload)
        status_line = await self._reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while (line := await self._reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        data = await self._reader.readexactly(length)
        return status, json.loads(data) if data else None

    async def close(self) -> None:
        self._writer.close()
        await self._writer.wait_closed()
