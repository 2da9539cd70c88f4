"""A TCP link between a mount tool and the local S3 server that a test can cut: the network
to S3 going away for real (connections reset, new ones refused), with the server and its data
intact behind it, so that what the bucket holds can be checked once the link is restored.

    link = S3Link(server).start()          # link.endpoint: give it to the mount tool
    link.cut_after(1 << 20)                # reset everything once 1 MiB more went upstream
    ...
    link.restore()
    assert link.stats()["resets"]          # the fault fired: connections reset or refused

The forwarding runs in a process of its own (this file, run as a script): a test thread that
blocks in a page fault on the mount while holding the GIL (safetensors' load_file mmaps) would
otherwise freeze the very threads that must carry the mount tool's request to S3.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
from typing import IO, Any, Optional

_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: the last close sends RST


class S3Link:
    """Controls a forwarder 127.0.0.1:<port> -> ``server``; stands in for it towards a mount
    tool. The kit's RealMount needs only ``endpoint`` from it; bucket calls (create, list,
    delete) go to the server itself, past the link."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.endpoint = ""
        self._proc: Optional[subprocess.Popen[str]] = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)

    def start(self) -> S3Link:
        port = int(self.server.endpoint.rsplit(":", 1)[1])
        self._proc = subprocess.Popen(
            [sys.executable, __file__, str(port), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.endpoint = self._ask("endpoint")["endpoint"]
        return self

    def cut(self) -> None:
        """The network goes away: reset every open connection, refuse new ones."""
        self._ask("cut")

    def cut_after(self, nbytes: int) -> None:
        """Cut once ``nbytes`` more bytes have gone upstream (mid-upload)."""
        self._ask(f"cut_after {nbytes}")

    def restore(self) -> None:
        self._ask("restore")

    def stats(self) -> dict[str, Any]:
        """{"up", "upstream_bytes", "resets" (connections reset or refused), "cuts"}."""
        return self._ask("stats")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _ask(self, command: str) -> dict[str, Any]:
        with self._lock:
            proc = self._proc
            assert proc is not None and proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the S3 link process exited (status {proc.poll()})")
        answer: dict[str, Any] = json.loads(line)
        return answer


# -- the forwarding process -------------------------------------------------------------------


class _Forwarder:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.up = True
        self.upstream_bytes = 0
        self.resets = 0
        self.cuts = 0
        self.cut_at: Optional[int] = None
        self.lock = threading.Lock()
        self.pairs: set[tuple[socket.socket, socket.socket]] = set()
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)

    @staticmethod
    def reset(sock: socket.socket, *, in_use: bool) -> None:
        """End a connection with RST. ``in_use``: a pump thread may be blocked in recv() on
        it; close() alone neither wakes that thread nor ends the connection while the recv
        holds it (the peer, a tool reusing a pooled keep-alive connection, would wait on a
        request nobody forwards), so shut it down first. Not otherwise: a FIN before the RST
        made rclone wait 40 s per refused request instead of failing it at once."""
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        if in_use:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()

    def cut(self) -> None:
        with self.lock:
            self.up = False
            self.cut_at = None
            self.cuts += 1
            pairs, self.pairs = self.pairs, set()
            self.resets += len(pairs)
        for client, upstream in pairs:
            self.reset(client, in_use=True)
            self.reset(upstream, in_use=True)

    def accept_forever(self) -> None:
        while True:
            client, _ = self.listener.accept()
            with self.lock:
                up = self.up
                if not up:
                    self.resets += 1
            if not up:
                self.reset(client, in_use=False)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
                upstream.settimeout(None)
            except OSError:
                self.reset(client, in_use=False)
                continue
            pair = (client, upstream)
            with self.lock:
                self.pairs.add(pair)
            threading.Thread(target=self.pump, args=(pair, True), daemon=True).start()
            threading.Thread(target=self.pump, args=(pair, False), daemon=True).start()

    def pump(self, pair: tuple[socket.socket, socket.socket], to_server: bool) -> None:
        source, sink = pair if to_server else pair[::-1]
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    with contextlib.suppress(OSError):
                        sink.shutdown(socket.SHUT_WR)
                    return
                if to_server:
                    with self.lock:
                        self.upstream_bytes += len(data)
                        trip = self.cut_at is not None and self.upstream_bytes >= self.cut_at
                    if trip:
                        self.cut()
                        return
                sink.sendall(data)
        except OSError:
            return

    def command(self, line: str) -> dict[str, Any]:
        word, _, arg = line.strip().partition(" ")
        if word == "cut":
            self.cut()
        elif word == "cut_after":
            with self.lock:
                self.cut_at = self.upstream_bytes + int(arg)
        elif word == "restore":
            with self.lock:
                self.up, self.cut_at = True, None
        elif word not in ("stats", "endpoint"):
            return {"error": f"unknown command {line.strip()!r}"}
        with self.lock:
            return {
                "endpoint": f"http://127.0.0.1:{self.listener.getsockname()[1]}",
                "up": self.up,
                "upstream_bytes": self.upstream_bytes,
                "resets": self.resets,
                "cuts": self.cuts,
            }


def _main(argv: list[str]) -> int:
    forwarder = _Forwarder(int(argv[0]))
    threading.Thread(target=forwarder.accept_forever, daemon=True).start()
    out: IO[str] = sys.stdout
    for line in sys.stdin:  # ends when the controlling test closes the pipe, or dies
        out.write(json.dumps(forwarder.command(line)) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
