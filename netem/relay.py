"""A user-space link emulator: an asyncio TCP relay that shapes each direction (netem/shaping.py).

Edges connect to `listen`; every connection is relayed to `upstream` through two shaped pipes. It
works with any TCP protocol, gRPC over HTTP/2 included, unmodified. `set_down(True)` emulates an
outage: open connections are cut and new ones refused until `set_down(False)`. The relay reads the
time and waits through its `Timing`: the real clock, or a test's virtual one, which shows the schedule
the relay kept whatever the machine's load.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .shaping import LinkSpec, Shaper

CHUNK = 64 * 1024


@dataclass
class LinkCounters:
    """Bytes and connections that crossed the link."""

    connections: int = 0
    up_bytes: int = 0
    down_bytes: int = 0


@dataclass(frozen=True)
class Timing:
    """Where the relay reads the time (seconds) and how it waits until a chunk's release time."""

    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep


@dataclass
class _Pipe:
    """One shaped direction of one connection."""

    shaper: Shaper
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class LinkEmulator:
    """The relay; start() binds, stop() closes everything."""

    def __init__(self, spec: LinkSpec, upstream: str, listen: str = "127.0.0.1:0", seed: int | None = None,
                 timing: Timing = Timing()) -> None:
        self.spec = spec
        self.timing = timing
        self.upstream = split_address(upstream)
        self.listen = split_address(listen)
        self.counters = LinkCounters()
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._down = False
        self._origin = timing.now()
        self.address = ""

    async def start(self) -> str:
        """Bind and return HOST:PORT."""
        self._server = await asyncio.start_server(self._accept, *self.listen)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"{host}:{port}"
        return self.address

    async def stop(self) -> None:
        """Close the listener and every relayed connection."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self._cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def set_down(self, down: bool) -> None:
        """Cut the link (close connections, refuse new ones) or bring it back."""
        self._down = down
        if down:
            self._cut()

    def _cut(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self._down:
            client_w.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.transport.abort()
            return
        if self._down:  # cut while this connection was being made: the cut never saw it
            client_w.transport.abort()
            up_w.transport.abort()
            return
        self.counters.connections += 1
        self._writers |= {client_w, up_w}
        up = _Pipe(Shaper(self.spec.up, random.Random(self._rng.random()), self._origin))
        down = _Pipe(Shaper(self.spec.down, random.Random(self._rng.random()), self._origin))
        loop = asyncio.get_running_loop()
        pumps = [loop.create_task(c) for c in (self._read(client_r, up, "up_bytes"), self._write(up, up_w),
                                               self._read(up_r, down, "down_bytes"), self._write(down, client_w))]
        self._tasks.update(pumps)
        for task in pumps:
            task.add_done_callback(self._tasks.discard)
        # A half-closed direction stays open for the other; the connection ends when both have.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(pumps[1], pumps[3], return_exceptions=True)
        for writer in (client_w, up_w):
            self._writers.discard(writer)
            writer.transport.abort()

    async def _read(self, reader: asyncio.StreamReader, pipe: _Pipe, counter: str) -> None:
        """Stamp each chunk with its release time as it arrives."""
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(CHUNK):
                setattr(self.counters, counter, getattr(self.counters, counter) + len(data))
                pipe.queue.put_nowait((pipe.shaper.release_time(self.timing.now(), len(data)), data))
        pipe.queue.put_nowait((0.0, b""))  # end of stream

    async def _write(self, pipe: _Pipe, writer: asyncio.StreamWriter) -> None:
        """Deliver chunks at their release times; pass the end of stream on as a half-close."""
        with contextlib.suppress(ConnectionError, OSError):
            while True:
                release, data = await pipe.queue.get()
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                wait = release - self.timing.now()
                if wait > 0:
                    await self.timing.sleep(wait)
                writer.write(data)
                await writer.drain()


class BackgroundLink:
    """A LinkEmulator on its own event-loop thread, for synchronous code (tests, experiments)."""

    def __init__(self, spec: LinkSpec, upstream: str, listen: str = "127.0.0.1:0", seed: int | None = None,
                 timing: Timing = Timing()) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="netem")
        self._thread.start()
        self.link = LinkEmulator(spec, upstream, listen, seed, timing)
        self.address = self._call(self.link.start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def set_down(self, down: bool) -> None:
        """Cut or restore the link, in effect when this returns (a no-op once the link is stopped).
        Waiting matters: a caller that cuts the link and then sends expects the send to meet the cut,
        which a loaded machine could otherwise run first."""
        if self._loop.is_closed():
            return

        async def apply() -> None:
            self.link.set_down(down)

        with contextlib.suppress(RuntimeError, concurrent.futures.TimeoutError):  # the loop is stopping
            asyncio.run_coroutine_threadsafe(apply(), self._loop).result(timeout=10)

    def stop(self) -> None:
        """Close the relay and its thread."""
        self._call(self.link.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> BackgroundLink:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT as (host, port), an empty host meaning 127.0.0.1; ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, got {address!r}")
    return host or "127.0.0.1", int(port)
