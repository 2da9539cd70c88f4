"""Local object-store servers, one shape for all: S3 (moto, seaweedfs), Azure (Azurite), GCS.

Each server runs on 127.0.0.1 only, on a free port, with its data in memory or in a private
temporary directory; nothing leaves the machine. Its client is whatever the user runs (obstore,
for safestage): :meth:`ObjectStoreServer.environment` gives the store's *standard* environment
variables, the ones a user sets for a real bucket, pointing at this server::

    from safestage.testing import new_bucket

    bucket = new_bucket("seaweedfs")          # on the process's shared server, a fresh name
    os.environ.update(bucket.environment)     # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...
    save_to(bucket.url + "/run")               # "s3://test-0123abcd4567/run"
    assert bucket.objects() == [...]           # the keys as the server holds them

Kinds (``STORE_KINDS``): ``moto`` and ``seaweedfs`` (``s3://``), ``azurite`` (``az://``),
``fake-gcs`` (``gs://``). One server per kind per process (:func:`shared_object_store`),
started on first use, stopped at exit; buckets keep tests apart. Each runs under the kit's
supervisor (``_process``), so it dies with the process that started it. A server that cannot
run here raises :class:`ObjectStoreUnavailable` naming what to install: never a skip.

What each server honours is in its module's docstring (``_s3``, ``_seaweedfs``, ``_azurite``,
``_fake_gcs``) and in docs/testing-kit.md.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Optional, TypeVar

from ._mount import RealMountUnavailable
from ._process import reap, spawn_supervised

log = logging.getLogger("safestage.testing")

STORE_KINDS: tuple[str, ...] = ("moto", "seaweedfs", "azurite", "fake-gcs")
START_TIMEOUT = 60.0  # seaweedfs starts in ~3 s, Azurite ~2 s, moto 2-5 s: more on a busy CI box
HTTP_TIMEOUT = 10.0

# The variables of each store's family: a process given a store's environment is given none
# of the caller's other variables of that family (an AWS_PROFILE, an AZURE_STORAGE_SAS_TOKEN).
ENV_PREFIXES: dict[str, tuple[str, ...]] = {
    "s3": ("AWS_",),
    "gs": ("GOOGLE_",),
    "az": ("AZURE_", "AZURITE_"),
}

# urllib honours http_proxy; the servers are on 127.0.0.1 and must be reached directly.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

_Server = TypeVar("_Server", bound="ObjectStoreServer")


class ObjectStoreUnavailable(RealMountUnavailable):
    """A local object-store server cannot run here: the message names what to install."""


class StoreRequestError(OSError):
    """A request of the kit to its local store failed (the message has the store's answer)."""

    def __init__(self, message: str, *, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status


def http_request(
    method: str,
    url: str,
    *,
    headers: Optional[Mapping[str, str]] = None,
    body: bytes = b"",
    what: str,
) -> bytes:
    """One request of the kit's own (bucket admin), without any proxy; the body of the answer."""
    data = body if body or method in ("PUT", "POST") else None
    request = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    try:
        with _opener.open(request, timeout=HTTP_TIMEOUT) as response:
            answer: bytes = response.read()
            return answer
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:500].decode(errors="replace")
        raise StoreRequestError(f"{what}: {method} {url}: HTTP {exc.code} {detail}", status=exc.code) from exc
    except (urllib.error.URLError, OSError) as exc:
        raise StoreRequestError(f"{what}: {method} {url}: {exc}") from exc


def free_port() -> int:
    """A port free on 127.0.0.1 now (for servers that cannot be told to pick one themselves)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def find_binary(name: str) -> Optional[str]:
    """``name`` next to this interpreter (a venv's bin, where pip and npm --prefix put it), else on PATH."""
    # sys.executable itself: a venv's bin (not the base interpreter's it links to).
    for directory in (Path(sys.executable).parent, Path(os.path.realpath(sys.executable)).parent):
        candidate = directory / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name)


class ObjectStoreServer(abc.ABC):
    """A local object-store server: ``start()``, buckets, and the environment that reaches it."""

    kind: ClassVar[str]  # one of STORE_KINDS
    scheme: ClassVar[str]  # "s3", "gs", "az": the URL scheme of its buckets

    endpoint: str
    started_in: Optional[float] = None  # seconds the last start() took

    @abc.abstractmethod
    def start(self: _Server) -> _Server:
        """Start the server; returns it. Raises ObjectStoreUnavailable if it cannot run here."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the server (its buckets vanish with it). Idempotent, bounded."""

    @abc.abstractmethod
    def is_running(self) -> bool: ...

    @property
    @abc.abstractmethod
    def pid(self) -> Optional[int]:
        """The pid of the supervisor that runs the server."""

    @abc.abstractmethod
    def log(self) -> str:
        """The server's output so far (its access log where it keeps one)."""

    @abc.abstractmethod
    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` (a container, for Azure)."""

    @abc.abstractmethod
    def list_objects(self, bucket: str) -> list[str]:
        """Every key in ``bucket``, sorted, as the server holds it."""

    @abc.abstractmethod
    def uploads_in_flight(self, bucket: str) -> list[str]:
        """The keys of the uploads in ``bucket`` begun in parts and neither finished nor
        aborted (S3 multipart uploads, Azure uncommitted blocks), sorted."""

    @abc.abstractmethod
    def delete_bucket(self, bucket: str) -> None:
        """Delete every object of ``bucket``, then the bucket."""

    @abc.abstractmethod
    def environment(self, bucket: str, *, endpoint: Optional[str] = None) -> dict[str, str]:
        """The store's standard environment variables that make obstore reach ``bucket`` here.

        ``endpoint`` replaces the server's own (a :class:`FaultProxy` in front of it)."""

    def url(self, bucket: str) -> str:
        """``scheme://bucket``: the URL of the bucket's root."""
        return f"{self.scheme}://{bucket}"

    def __enter__(self: _Server) -> _Server:
        return self.start()

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.stop()


class _PortTaken(Exception):
    """The server lost the race for the port the kit chose for it: start again."""


class SupervisedServer(ObjectStoreServer):
    """A server binary run under the kit's supervisor, its output in a private log file."""

    name: ClassVar[str]  # the server's name in messages
    install_hint: ClassVar[str]  # what to install when its binary is missing
    _START_TRIES = 3

    def __init__(self, *, timeout: float = START_TIMEOUT) -> None:
        self.timeout = timeout
        self.endpoint = ""
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._ctl: Optional[Path] = None
        self._last_log = ""

    @abc.abstractmethod
    def _command(self, ctl: Path) -> list[str]:
        """The command that runs the server, its files under ``ctl``."""

    def _removed_on_exit(self) -> tuple[Path, ...]:
        """Files the server leaves outside its directory, for the supervisor to remove if the
        test process dies (known once ``_command`` ran)."""
        return ()

    @abc.abstractmethod
    def _probe(self) -> Optional[str]:
        """The endpoint once the server answers requests, else None."""

    def _ready(self) -> None:
        """Anything to do once the server answers (a front to start)."""

    def _exited(self, code: int, text: str) -> Optional[BaseException]:
        """The error to raise for an exit with status ``code`` before it answered (its output
        ``text``), where the server says more than its status (None: a plain RuntimeError)."""
        return None

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self: _Server) -> _Server:
        assert isinstance(self, SupervisedServer)
        if self._proc is not None:
            raise RuntimeError(f"this {self.name} server is already started")
        began = time.monotonic()
        for attempt in range(1, self._START_TRIES + 1):
            self._ctl = Path(tempfile.mkdtemp(prefix=f"safestage-{self.kind}-"))
            try:
                command = self._command(self._ctl)
                remove = [self._ctl, *self._removed_on_exit()]
                self._proc = spawn_supervised(command, log_path=self._ctl / "server.log", remove=remove, cwd=self._ctl)
                self.endpoint = self._wait_ready()
                self._ready()
                break
            except _PortTaken:
                log.info("%s lost its port to another process (try %d); starting it again", self.name, attempt)
                self.stop()
                if attempt == self._START_TRIES:
                    raise RuntimeError(f"{self.name} could not bind a free port in {attempt} tries:\n{self._last_log}") from None
            except BaseException:
                self.stop()
                raise
        self.started_in = time.monotonic() - began
        log.debug("%s at %s, pid %s, started in %.2f s", self.name, self.endpoint, self.pid, self.started_in)
        return self

    def _wait_ready(self) -> str:
        assert self._proc is not None
        deadline = time.monotonic() + self.timeout
        while True:
            endpoint = self._probe()
            if endpoint:
                return endpoint
            code = self._proc.poll()
            if code is not None:
                text = self.log()
                if "address already in use" in text.lower() or "EADDRINUSE" in text:
                    raise _PortTaken()
                said = self._exited(code, text)
                if said is not None:
                    raise said
                raise RuntimeError(f"{self.name} exited with status {code} before it answered:\n{text[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not answer within {self.timeout:.0f} s:\n{self.log()[-4000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        try:
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                reap(proc, grace=5.0)
        finally:
            self.log()
            if self._ctl is not None:
                shutil.rmtree(self._ctl, ignore_errors=True)
                self._ctl = None

    def log(self) -> str:
        if self._ctl is not None:
            with contextlib.suppress(FileNotFoundError):
                self._last_log = (self._ctl / "server.log").read_text(encoding="utf-8", errors="replace")
        return self._last_log

    def _need(self, binary: Optional[str], what: str) -> str:
        if binary is None:
            raise ObjectStoreUnavailable(f"{self.name} cannot run here: {what} is missing: {self.install_hint}")
        return binary


# -- one server per kind per process ----------------------------------------------------------


_shared: dict[str, ObjectStoreServer] = {}
_shared_lock = threading.Lock()


def shared_server(kind: str, factory: Callable[[], ObjectStoreServer]) -> ObjectStoreServer:
    """The process's server of ``kind`` (``factory`` makes one), started on first use (again if
    it died), stopped at exit. The kinds' modules and ``_store_kinds`` call it."""
    with _shared_lock:
        server = _shared.get(kind)
        if server is None or not server.is_running():
            if server is not None:
                log.warning("the shared %s server died; starting a new one:\n%s", kind, server.log()[-2000:])
                server.stop()
            server = factory()
            _shared[kind] = server.start()
        return server


def stop_shared_object_stores(kinds: Optional[Iterable[str]] = None) -> None:
    """Stop the shared servers of ``kinds`` (default: every one) this process started."""
    with _shared_lock:
        servers = [_shared.pop(kind) for kind in list(kinds if kinds is not None else _shared) if kind in _shared]
    for server in servers:
        server.stop()


atexit.register(stop_shared_object_stores)


# -- a bucket of a test --------------------------------------------------------------------------


def store_environment(
    scheme: str, variables: Mapping[str, str], base: Optional[Mapping[str, str]] = None
) -> dict[str, str]:
    """``base`` (default: os.environ) without its variables of the store's family, plus ``variables``."""
    prefixes = ENV_PREFIXES[scheme]
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(prefixes)}
    env.update(variables)
    return env


@dataclass(frozen=True)
class StoreBucket:
    """A bucket (an Azure container) on a local server."""

    server: ObjectStoreServer
    name: str

    @property
    def url(self) -> str:
        """``s3://name``, ``gs://name`` or ``az://name``."""
        return self.server.url(self.name)

    @property
    def environment(self) -> dict[str, str]:
        """The store's standard variables that reach this bucket (see ObjectStoreServer.environment)."""
        return self.server.environment(self.name)

    def process_env(self, base: Optional[Mapping[str, str]] = None, *, endpoint: Optional[str] = None) -> dict[str, str]:
        """An environment for a child process: ``base`` less its variables of this store's family,
        plus this bucket's (through ``endpoint``, a FaultProxy's URL, when given)."""
        return store_environment(self.server.scheme, self.server.environment(self.name, endpoint=endpoint), base)

    def objects(self) -> list[str]:
        """Every key in the bucket, sorted, as the server holds it."""
        return self.server.list_objects(self.name)

    def delete(self) -> None:
        """Delete the bucket and everything in it."""
        self.server.delete_bucket(self.name)
