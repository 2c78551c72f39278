"""A fault-injecting TCP proxy for tests: client -> proxy -> S3 server, with seeded faults.

It listens on a free port of 127.0.0.1 and forwards every connection to an
upstream server (the moto S3 server). At a set rate per connection, chosen by a
seeded RNG so a failing run can be replayed, it injects one fault:

- ``drop``: the connection is reset as soon as it is accepted, before any byte;
- ``reset``: after N bytes (both directions counted) both sides are reset
  (SO_LINGER 0, so the peers see RST, not a clean FIN), usually mid-body;
- ``stall``: after N bytes the proxy stops forwarding (and stops reading, so
  the sender's buffers fill up) for ``stall_seconds``, then resets both sides;
- ``corrupt`` (only when asked for): the byte at offset N is flipped, and
  forwarding goes on as if nothing happened;
- ``late-continue`` (only when asked for): the first request past N bytes
  goes through whole (body included); ``continue_delay`` later the proxy sends
  the client an interim ``100 Continue`` of its own and then stalls as above:
  a server that took the request and went silent, after an interim answer
  that came late (moto sends two ``100 Continue``, the second one at random
  before or after the body is out);
- ``answer-reset``, ``answer-stall``, ``answer-500`` (only when asked for): the
  request reaches the server whole and the server acts on it, but its answer
  never reaches the client, which gets a reset, a stall (then a reset) or a
  ``500 InternalError`` instead: a PUT that was stored although the client
  saw it fail;
- ``error-500`` (only when asked for): the request never reaches the server;
  the client gets a ``500 InternalError`` (queue many for a server that keeps
  failing, as one restarting does).

``force(kind, n, offset, match)`` queues ``n`` faults regardless of the rate;
each is taken by the first connection that reaches ``offset`` bytes (and
carries a request whose head contains ``match``: ``"PUT /bucket/key?query"``
then one ``"\\nname: value"`` line per header, names in lower case; a tuple
must all be in one request's head), for tests that need a
fault at a known point. A connection gets at most one fault. Note that moto's
server closes every connection after one response.

It also records the HTTP request lines the clients sent (``requests``), so a
test can prove that a request was *not* made. Everything is bounded in time:
each connection has its own thread, sockets have timeouts, and ``stop()``
wakes and joins every thread.
"""

from __future__ import annotations

import contextlib
import random
import select
import socket
import struct
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest

KINDS = ("drop", "reset", "stall")  # the kinds drawn at random by default
ANSWER_KINDS = ("answer-reset", "answer-stall", "answer-500")  # the server acts, the client never hears
ALL_KINDS = (*KINDS, "corrupt", "late-continue", *ANSWER_KINDS, "error-500")
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_ERROR_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error. Please try again.</Message></Error>"
)
_INTERNAL_ERROR = (
    b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/xml\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(_ERROR_BODY) + _ERROR_BODY
)
_CHUNK = 256 << 10
_POLL = 0.1


@dataclass
class Fault:
    kind: str
    offset: int  # after this many bytes (both directions) of the connection
    match: str | tuple[str, ...] = ""  # only on a connection with a request whose head contains this
    fired: bool = False
    request: int = 0  # answer and error kinds: the number of the request (on its connection) they hit


@dataclass
class FaultProxy:
    """Forwards 127.0.0.1:<port> to ``upstream`` (an ``http://host:port`` URL), injecting faults."""

    upstream: str
    rate: float = 0.0  # probability that a new connection gets a fault
    kinds: tuple[str, ...] = KINDS
    seed: int = 0
    stall_seconds: float = 5.0
    continue_delay: float = 0.5  # late-continue: the client is done sending by then, its timeouts running
    max_offset: int = 4 << 20  # a reset or stall happens after 1..max_offset bytes
    counts: Counter = field(default_factory=Counter)  # "connections" and one count per fault kind
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path?query)

    def __post_init__(self) -> None:
        parts = urlsplit(self.upstream)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._forced: list[Fault] = []
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        sock.settimeout(_POLL)
        self._listener, self.port = sock, sock.getsockname()[1]
        self._spawn(self._accept_loop)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        for t in list(self._threads):
            t.join(timeout)
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def faults(self) -> int:
        return sum(self.counts[k] for k in ALL_KINDS)

    def force(
        self, kind: str, n: int = 1, offset: int | None = None, match: str | tuple[str, ...] = ""
    ) -> None:
        """Queue ``n`` ``kind`` faults, each after ``offset`` bytes (default: drawn) of a connection.

        A queued fault waits for a connection that gets that far and, if ``match``
        is given, that carries a request whose head contains it (``"partNumber=3"``,
        ``("PUT /bucket/key", "\\nif-match:")``).
        The answer and error kinds hit that request, and match only the newest request's head.
        """
        assert kind in ALL_KINDS, kind
        with self._lock:
            for _ in range(n):
                at = offset if offset is not None else self._rng.randint(1, self.max_offset)
                if offset is None and (kind in ANSWER_KINDS or kind == "error-500"):
                    at = 0
                self._forced.append(Fault(kind, at, match))

    def reseed(self, seed: int) -> None:
        """Restart the fault sequence from ``seed`` (the rate applies from the next connection)."""
        with self._lock:
            self.seed = seed
            self._rng.seed(seed)

    def clear_forced(self) -> None:
        with self._lock:
            self._forced.clear()

    def reset_counts(self) -> None:
        with self._lock:
            self.counts.clear()
            self.requests.clear()

    def methods(self) -> Counter:
        """How many requests of each HTTP method went through."""
        with self._lock:
            return Counter(m for m, _ in self.requests)

    # -- internals ---------------------------------------------------------------------------

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="faultproxy")
        t.start()
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            self._spawn(self._serve, client)

    def _plan(self) -> Fault | None:
        """The fault drawn for a new connection (queued drops first; other queued faults are claimed)."""
        with self._lock:
            self.counts["connections"] += 1
            if self._forced and self._forced[0].kind == "drop":
                return self._forced.pop(0)
            if self._rng.random() >= self.rate:
                return None
            return Fault(self._rng.choice(self.kinds), self._rng.randint(1, self.max_offset))

    def _claim(self, moved: int, targets: list[str]) -> Fault | None:
        """The first queued fault this connection has reached (offset and match), taken off the queue."""
        with self._lock:
            for i, f in enumerate(self._forced):
                heads = targets[-1:] if f.kind in ANSWER_KINDS or f.kind == "error-500" else targets
                if (
                    f.kind != "drop"
                    and moved >= f.offset
                    and (not f.match or any(_matches(f.match, t) for t in heads))
                ):
                    return self._forced.pop(i)
        return None

    def _errors_queued(self) -> bool:
        with self._lock:
            return any(f.kind == "error-500" for f in self._forced)

    def _next_offset(self, fault: Fault | None, moved: int) -> int | None:
        """The nearest byte count at which a fault may fire: reads stop there."""
        if fault is not None:
            return fault.offset if not fault.fired and fault.offset > moved else None
        with self._lock:
            ahead = [f.offset for f in self._forced if f.kind != "drop" and f.offset > moved]
        return min(ahead, default=None)

    def _serve(self, client: socket.socket) -> None:
        fault = self._plan()
        if fault is not None and fault.kind == "drop":
            self._count("drop")
            _reset(client)
            return
        try:
            upstream = socket.create_connection(self._target, timeout=5)
        except OSError:
            _reset(client)
            return
        fatal = False
        try:
            fatal = self._pump(client, upstream, fault)
        except OSError:
            fatal = True  # a peer reset us: pass the reset on
        finally:
            for sock in (client, upstream):
                if fatal:
                    _reset(sock)
                else:
                    sock.close()

    def _pump(self, client: socket.socket, upstream: socket.socket, fault: Fault | None) -> bool:
        """Forward both ways until both sides closed (False) or a fatal fault was injected (True)."""
        peer = {client: upstream, upstream: client}
        for s in peer:
            s.settimeout(5)
        open_ = set(peer)  # sides still sending
        moved, parser, targets = 0, RequestParser(), []
        held = b""  # the start of a request head, forwarded once the request is known not to be failed
        while open_ and not self._stop.is_set():
            ready, _, _ = select.select(list(open_), [], [], _POLL)
            for src in ready:
                limit = self._next_offset(fault, moved)
                data = src.recv(_CHUNK if limit is None else max(1, min(_CHUNK, limit - moved)))
                if not data:  # a clean end of one direction: pass the FIN on
                    open_.discard(src)
                    peer[src].shutdown(socket.SHUT_WR)
                    continue
                if src is client:
                    found = parser.feed(data)
                    targets += parser.heads[len(targets) :]
                    self._record(found)
                moved += len(data)
                if fault is None and (fault := self._claim(moved, targets)) is not None:
                    fault.request = len(targets)
                if fault is not None and fault.kind == "error-500" and not fault.fired and src is client:
                    held = b""  # no byte of the failed request reaches the server
                    waits = "\nexpect: 100-continue" in targets[fault.request - 1].lower()
                    if parser.ended >= fault.request or waits:  # received whole, or waiting: answer it
                        fault.fired = True
                        self._count(fault.kind)
                        client.sendall(_INTERNAL_ERROR)
                        return False
                    continue
                if src is client and (held or (parser.in_head() and self._errors_queued())):
                    held += data
                    if parser.in_head():
                        continue
                    data, held = held, b""
                if fault is not None and fault.kind in ANSWER_KINDS and not fault.fired:
                    if src is upstream and parser.ended >= fault.request:  # the answer: lose it
                        fault.fired = True
                        self._count(fault.kind)
                        if fault.kind == "answer-500":
                            client.sendall(_INTERNAL_ERROR)
                            return False
                        if fault.kind == "answer-stall":
                            self._stop.wait(self.stall_seconds)
                        return True
                    peer[src].sendall(data)
                    continue
                if _due(fault, moved, request_over=src is client and parser.ended > 0):
                    assert fault is not None
                    fault.fired = True
                    if fault.kind != "corrupt":
                        peer[src].sendall(data)
                        self._fault(fault.kind, client)
                        return True
                    data = data[:-1] + bytes([data[-1] ^ 0xFF])
                    self._count(fault.kind)
                peer[src].sendall(data)
        return False

    def _fault(self, kind: str, client: socket.socket) -> None:
        self._count(kind)
        if kind == "late-continue":
            self._stop.wait(self.continue_delay)
            client.sendall(_CONTINUE)
        if kind in ("stall", "late-continue"):
            self._stop.wait(self.stall_seconds)

    def _record(self, requests: list[tuple[str, str]]) -> None:
        if requests:
            with self._lock:
                self.requests.extend(requests)

    def _count(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1


def _matches(match: str | tuple[str, ...], head: str) -> bool:
    return all(m in head for m in ((match,) if isinstance(match, str) else match))


def _due(fault: Fault | None, moved: int, *, request_over: bool) -> bool:
    """Whether ``fault`` fires now (a late-continue waits for the end of a request past its offset)."""
    if fault is None or fault.fired or moved < fault.offset:
        return False
    return fault.kind != "late-continue" or request_over


class RequestParser:
    """Splits a client's byte stream into HTTP/1.1 requests (Content-Length or chunked bodies)."""

    def __init__(self) -> None:
        self.buf = b""
        self.body = 0  # body bytes still to skip
        self.chunked = False
        self.ended = 0  # requests received whole, body included
        self.heads: list[str] = []  # "METHOD target" and "\nname: value" per header, one per request

    def in_head(self) -> bool:
        """Whether the bytes fed so far end inside a request head."""
        return not self.body and not self.chunked and bool(self.buf)

    def feed(self, data: bytes) -> list[tuple[str, str]]:
        """Request lines (method, target) completed by ``data``."""
        self.buf += data
        found: list[tuple[str, str]] = []
        while self._step(found):
            pass
        return found

    def _step(self, found: list[tuple[str, str]]) -> bool:
        if self.body:
            n = min(self.body, len(self.buf))
            self.buf, self.body = self.buf[n:], self.body - n
            if not self.body and not self.chunked:
                self.ended += 1
            return bool(self.buf)
        if self.chunked:
            return self._chunk()
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        head, self.buf = self.buf[:end].decode("latin-1"), self.buf[end + 4 :]
        line, *fields = head.split("\r\n")
        method, target, *_ = [*line.split(" "), "", ""]
        found.append((method, target))
        headers = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
        self.heads.append(f"{method} {target}" + "".join(f"\n{k}: {v}" for k, v in headers.items()))
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self.body = 0 if self.chunked else int(headers.get("content-length") or 0)
        if not self.chunked and not self.body:
            self.ended += 1
        return True

    def _chunk(self) -> bool:
        end = self.buf.find(b"\r\n")
        if end < 0:
            return False
        size = int(self.buf[:end].split(b";")[0] or b"0", 16)
        if size:  # skip the chunk's data and its CRLF
            self.buf, self.body = self.buf[end + 2 :], size + 2
            return True
        close = self.buf.find(b"\r\n\r\n", end)  # the last chunk, optional trailers, a blank line
        if close < 0:
            return False
        self.buf, self.chunked = self.buf[close + 4 :], False
        self.ended += 1
        return True


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer sees a TCP reset."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.fixture
def fault_proxy(s3_server: str) -> Iterator[FaultProxy]:
    """A proxy in front of the S3 server (SeaweedFS), no faults until the test sets ``rate``."""
    with FaultProxy(s3_server) as proxy:
        yield proxy


@pytest.fixture
def moto_fault_proxy(moto_server: str) -> Iterator[FaultProxy]:
    """A proxy in front of moto, for the tests whose point is a mock."""
    with FaultProxy(moto_server) as proxy:
        yield proxy
