"""A fault-injecting HTTP proxy in front of a local object store, and its request log.

The proxy is a reverse proxy on 127.0.0.1 (a thread of the test process) that a client reaches
through the store's ordinary endpoint variable (``bucket.process_env(endpoint=proxy.endpoint)``
or :func:`StoreBucket.environment` with the proxy's endpoint). It forwards each request as it
came, Host header included (a SigV4 signature covers it), and can instead::

    with FaultProxy(bucket.server.endpoint) as proxy:
        proxy.fail(503, method="PUT", query="partNumber", times=2)   # the next 2 UploadParts: 503
        proxy.reset(method="PUT", query="partNumber", after_bytes=1 << 20)   # read 1 MiB, then RST
        proxy.fail(412, method="PUT", path="_SAFESTAGE_COMMIT.json")  # a conditional create refused
        proxy.fail(500, method="PUT", forward=True)   # done by the store, then answered 500
        proxy.delay(0.5, method="GET")                                # a slow store
        proxy.lose_answer(method="PUT", path="_SAFESTAGE_COMMIT.json")  # done, answer lost
        proxy.cut_answer(method="GET", query="uploads", after_bytes=100)  # part of an answer, then FIN
        ...
        assert proxy.count(method="GET", query="list-type") == 1      # one LIST
        assert fault.fired == 2                                       # the fault really fired

A fault matches a request by method, a query parameter present (``"partNumber"``, or
``"comp=block"`` to match a value too), a substring of the unquoted path, and a request header
present; each given criterion must hold. ``times``: how many matching requests it takes (None:
every one from now on). The first live fault that matches wins. A refused request (``fail``,
``reset``) never reaches the store; a ``lose_answer`` one does, and the store acts on it, but its
answer never reaches the client (the connection is reset instead): a client that retries then
meets its own first attempt. Every request is logged (:meth:`requests`), faulted or not.

The request body is read whole before it is forwarded, and the answer too: fine for tests,
not a production proxy.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Optional

log = logging.getLogger("safestage.testing")

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
               "transfer-encoding", "upgrade", "proxy-connection"}  # fmt: skip
_UPSTREAM_TIMEOUT = 120.0

# What each injected status says, in the XML error shape S3 and Azure answer with (obstore reads
# the status; the body is for the person reading the error).
_CODES = {412: "PreconditionFailed", 500: "InternalError", 503: "SlowDown", 429: "SlowDown"}


@dataclass(frozen=True)
class ProxiedRequest:
    """One request that reached the proxy: what it asked, and what it was answered."""

    method: str
    path: str  # unquoted, without the query
    query: Mapping[str, str]  # each parameter's first value ("" for a bare ?uploads)
    headers: Mapping[str, str]  # lower-case names
    status: Optional[int]  # None: the connection was reset
    fault: Optional[str]  # "status 503", "reset after 1048576 bytes", "delay 0.5 s", or None
    body_bytes: int  # of the request, as far as the proxy read it


@dataclass
class Fault:
    """A fault armed on the proxy; ``fired`` counts the requests it took."""

    action: str  # "status", "reset", "delay", "lose", "cut"
    method: Optional[str] = None
    query: Optional[str] = None
    path: Optional[str] = None
    header: Optional[str] = None
    times: Optional[int] = 1
    status: int = 0
    after_bytes: int = 0
    seconds: float = 0.0
    forward: bool = False  # a status fault: the store got the request (its answer lost)
    fired: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def matches(self, method: str, path: str, query: Mapping[str, str], headers: Mapping[str, str]) -> bool:
        if self.method is not None and method != self.method.upper():
            return False
        if self.path is not None and self.path not in path:
            return False
        if self.header is not None and self.header.lower() not in headers:
            return False
        if self.query is not None:
            name, has_value, value = self.query.partition("=")
            if name not in query or (has_value and query[name] != value):
                return False
        return True

    def take(self) -> bool:
        """Claim one firing; False once ``times`` are spent."""
        with self._lock:
            if self.times is not None and self.fired >= self.times:
                return False
            self.fired += 1
            return True

    def describe(self) -> str:
        if self.action == "status":
            return f"status {self.status}"
        if self.action == "reset":
            return f"reset after {self.after_bytes} bytes"
        if self.action == "lose":
            return "answer lost"
        if self.action == "cut":
            return f"answer cut after {self.after_bytes} bytes"
        return f"delay {self.seconds} s"


class FaultProxy:
    """A reverse proxy on ``http://127.0.0.1:<port>`` in front of ``upstream``."""

    def __init__(self, upstream: str) -> None:
        parts = urllib.parse.urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise ValueError(f"FaultProxy needs an http://host:port upstream, not {upstream!r}")
        self.upstream = upstream
        self._target = (parts.hostname, parts.port)
        self._faults: list[Fault] = []
        self._log: list[ProxiedRequest] = []
        self._lock = threading.Lock()
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None
        self.endpoint = ""

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        if self._server is not None:
            raise RuntimeError("this FaultProxy is already started")
        proxy = self

        class Handler(_Handler):
            owner = proxy

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        self.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        self._thread = threading.Thread(target=server.serve_forever, name="safestage-fault-proxy", daemon=True)
        self._thread.start()
        log.debug("fault proxy at %s in front of %s", self.endpoint, self.upstream)
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.stop()

    # -- faults --------------------------------------------------------------------------------

    def fail(self, status: int, *, method: Optional[str] = None, query: Optional[str] = None,
             path: Optional[str] = None, header: Optional[str] = None, times: Optional[int] = 1,
             forward: bool = False) -> Fault:  # fmt: skip
        """Answer ``status`` (500, 503, 412...) to the next ``times`` matching requests,
        without forwarding them; ``forward``: after the store has done each (its own answer
        dropped), as a store that applies a request and then fails to answer it."""
        return self._arm(Fault("status", method, query, path, header, times, status=status, forward=forward))

    def reset(self, *, method: Optional[str] = None, query: Optional[str] = None, path: Optional[str] = None,
              header: Optional[str] = None, after_bytes: int = 0, times: Optional[int] = 1) -> Fault:  # fmt: skip
        """Read ``after_bytes`` of the next matching requests' bodies, then reset the
        connection (TCP RST): a network cut mid-upload."""
        return self._arm(Fault("reset", method, query, path, header, times, after_bytes=after_bytes))

    def delay(self, seconds: float, *, method: Optional[str] = None, query: Optional[str] = None,
              path: Optional[str] = None, header: Optional[str] = None, times: Optional[int] = None) -> Fault:  # fmt: skip
        """Hold matching requests ``seconds`` before forwarding them: a slow store."""
        return self._arm(Fault("delay", method, query, path, header, times, seconds=seconds))

    def lose_answer(self, *, method: Optional[str] = None, query: Optional[str] = None,
                    path: Optional[str] = None, header: Optional[str] = None, times: Optional[int] = 1) -> Fault:  # fmt: skip
        """Forward the next matching requests to the store, then reset the connection instead of
        answering: the store did the work, the client never hears of it."""
        return self._arm(Fault("lose", method, query, path, header, times))

    def cut_answer(self, *, method: Optional[str] = None, query: Optional[str] = None, path: Optional[str] = None,
                   header: Optional[str] = None, after_bytes: int = 0, times: Optional[int] = 1) -> Fault:  # fmt: skip
        """Forward the next matching requests, then send the store's status and headers (its
        Content-Length too) but only ``after_bytes`` of its answer's body, and close the
        connection: an answer cut short (the client reads a body shorter than announced)."""
        return self._arm(Fault("cut", method, query, path, header, times, after_bytes=after_bytes))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _arm(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def _fault_for(self, method: str, path: str, query: Mapping[str, str], headers: Mapping[str, str]) -> Optional[Fault]:
        with self._lock:
            faults = list(self._faults)
        for fault in faults:
            if fault.matches(method, path, query, headers) and fault.take():
                return fault
        return None

    # -- the log -------------------------------------------------------------------------------

    def requests(self, *, method: Optional[str] = None, query: Optional[str] = None,
                 path: Optional[str] = None) -> list[ProxiedRequest]:  # fmt: skip
        """The requests so far, in arrival order, those matching the criteria (as a fault's)."""
        probe = Fault("log", method, query, path)
        with self._lock:
            return [r for r in self._log if probe.matches(r.method, r.path, r.query, r.headers)]

    def count(self, *, method: Optional[str] = None, query: Optional[str] = None, path: Optional[str] = None) -> int:
        return len(self.requests(method=method, query=query, path=path))

    def clear_log(self) -> None:
        with self._lock:
            self._log.clear()

    def _record(self, entry: ProxiedRequest) -> None:
        with self._lock:
            self._log.append(entry)


class _Handler(BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's pool expects
    _upstream: Optional[http.client.HTTPConnection] = None

    def log_message(self, format: str, *args: object) -> None:
        pass  # the proxy's own log is the record

    def _dispatch(self) -> None:
        split = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(split.path)
        query = {k: v[0] for k, v in urllib.parse.parse_qs(split.query, keep_blank_values=True).items()}
        headers = {name.lower(): value for name, value in self.headers.items()}
        method = self.command
        fault = self.owner._fault_for(method, path, query, headers)

        def record(status: Optional[int], nbytes: int) -> None:
            self.owner._record(ProxiedRequest(method, path, query, headers, status,
                                              fault.describe() if fault else None, nbytes))  # fmt: skip

        if fault is not None and fault.action == "reset":
            taken = self._read_body(limit=fault.after_bytes)
            record(None, len(taken))
            self._reset()
            return
        body = self._read_body()
        # Each request is logged before its answer is sent: a client that has its answer finds
        # its request in the log.
        if fault is not None and fault.action == "status":
            if fault.forward:
                with contextlib.suppress(OSError, http.client.HTTPException):
                    self._forward(method, body)
            record(fault.status, len(body))
            self._answer_fault(fault.status)
            return
        if fault is not None and fault.action == "delay":
            time.sleep(fault.seconds)
        try:
            status, answer_headers, answer = self._forward(method, body)
        except (OSError, http.client.HTTPException) as exc:
            log.warning("fault proxy: %s %s to %s failed: %s", method, self.path, self.owner.upstream, exc)
            record(502, len(body))
            self._answer_fault(502)
            return
        record(status, len(body))
        if fault is not None and fault.action == "lose":
            self._reset()
            return
        self.send_response(status)
        for name, value in answer_headers:
            if name.lower() not in _HOP_BY_HOP and (name.lower() != "content-length" or method == "HEAD"):
                self.send_header(name, value)
        if method != "HEAD":
            self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        if fault is not None and fault.action == "cut":
            self.wfile.write(answer[: fault.after_bytes])
            self.wfile.flush()
            self.close_connection = True  # a FIN, not a reset: the client reads a short body
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return
        if method != "HEAD":
            self.wfile.write(answer)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _dispatch

    def _read_body(self, *, limit: Optional[int] = None) -> bytes:
        """The request body (de-chunked); at most ``limit`` bytes of it."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            pieces: list[bytes] = []
            while limit is None or sum(map(len, pieces)) < limit:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                pieces.append(self.rfile.read(size))
                self.rfile.readline()
            data = b"".join(pieces)
            return data if limit is None else data[:limit]
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length if limit is None else min(length, limit))

    def _reset(self) -> None:
        # SO_LINGER with a zero timeout: close() sends RST instead of FIN, as a cut network does.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.close()

    def _answer_fault(self, status: int) -> None:
        code = _CODES.get(status, "InjectedFault")
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>injected by safestage's FaultProxy</Message></Error>").encode()  # fmt: skip
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(self, method: str, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        for attempt in (1, 2):  # a kept-alive upstream connection the store closed: once more
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*self.owner._target, timeout=_UPSTREAM_TIMEOUT)
            connection = self._upstream
            try:
                connection.putrequest(method, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                        connection.putheader(name, value)
                if body or method in ("PUT", "POST", "PATCH"):
                    connection.putheader("Content-Length", str(len(body)))
                connection.endheaders(body or None)
                response = connection.getresponse()
                answer = response.read()
                if response.will_close:
                    connection.close()
                    self._upstream = None
                return response.status, response.getheaders(), answer
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                connection.close()
                self._upstream = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def finish(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            super().finish()
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None
