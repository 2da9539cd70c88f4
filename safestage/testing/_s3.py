"""A local S3 server for the real mounts: moto in its own process, on 127.0.0.1 only.

One server per process is shared by every S3 mount (:func:`shared_s3_server`): moto takes
seconds to import, buckets keep mounts apart, and a bucket must outlive a remount. It is
stopped at interpreter exit or by :func:`stop_shared_s3_server`; the supervisor stops it if
the process dies first. The kit's own requests (bucket create/list/delete) use urllib: no
boto3 in the caller's process.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

from ._mount import RealMountUnavailable
from ._process import reap, spawn_supervised

log = logging.getLogger("safestage.testing")

START_TIMEOUT = 60.0  # importing moto (and its many backends) takes 2-5 s, more on a busy CI box
_HTTP_TIMEOUT = 10.0
_SERVER_SCRIPT = Path(__file__).with_name("_s3_server.py")
_EXIT_NO_MOTO = 3  # keep in sync with _s3_server.EXIT_NO_MOTO
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # werkzeug colours its access log even into a file

ACCESS_KEY = "safestage"  # moto accepts any credentials; these only have to be well-formed
SECRET_KEY = "safestage-secret"
REGION = "us-east-1"

MOTO_HINT = "install it into this interpreter: pip install 'moto[server]' (safestage pins it in .ci/constraints-real.txt)"

# moto picks the service from the SigV4 credential scope; an unsigned request is routed by
# guessing from its path. Naming s3 in the scope makes the kit's requests unambiguous (moto does
# not check signatures unless told to).
_AUTH = f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/20200101/{REGION}/s3/aws4_request, SignedHeaders=host, Signature=0"

# urllib honours http_proxy; this server is on 127.0.0.1 and must be reached directly.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class S3Error(OSError):
    """A request of the kit to the local S3 server failed."""


class S3Server:
    """moto's S3 on ``endpoint`` (``http://127.0.0.1:<free port>``), data in memory."""

    def __init__(self, *, timeout: float = START_TIMEOUT) -> None:
        self.timeout = timeout
        self.endpoint = ""
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._ctl: Optional[Path] = None
        self._last_log = ""

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> S3Server:
        if self._proc is not None:
            raise RuntimeError("this S3Server is already started")
        self._ctl = Path(tempfile.mkdtemp(prefix="safestage-s3-"))
        try:
            port_file = self._ctl / "port"
            self._proc = spawn_supervised(
                [sys.executable, str(_SERVER_SCRIPT), "--port-file", str(port_file)],
                log_path=self._ctl / "server.log",
                remove=[self._ctl],
            )
            self.endpoint = f"http://127.0.0.1:{self._wait_port(port_file)}"
            self._request("GET", "/")  # ListBuckets: the app answers, not just the socket
        except BaseException:
            self.stop()
            raise
        log.debug("S3 server (moto) at %s, pid %s", self.endpoint, self.pid)
        return self

    def stop(self) -> None:
        """Stop the server (its buckets vanish with it). Idempotent, bounded."""
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
        """The server's output: moto's access log, one line per request, with times."""
        if self._ctl is not None:
            with contextlib.suppress(FileNotFoundError):
                text = (self._ctl / "server.log").read_text(encoding="utf-8", errors="replace")
                self._last_log = _ANSI.sub("", text)
        return self._last_log

    def _wait_port(self, port_file: Path) -> int:
        assert self._proc is not None
        deadline = time.monotonic() + self.timeout
        while True:
            with contextlib.suppress(FileNotFoundError, ValueError):
                return int(port_file.read_text(encoding="ascii"))
            code = self._proc.poll()
            if code is not None:
                text = self.log()
                if code == _EXIT_NO_MOTO:
                    raise RealMountUnavailable(f"moto is not installed in {sys.executable}: {MOTO_HINT}\n{text}")
                raise RuntimeError(f"the S3 server (moto) exited with status {code} before listening:\n{text}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the S3 server (moto) did not listen within {self.timeout:.0f} s:\n{self.log()}")
            time.sleep(0.05)

    # -- buckets --------------------------------------------------------------------------

    def create_bucket(self, bucket: str) -> None:
        self._request("PUT", f"/{bucket}")

    def list_objects(self, bucket: str) -> list[str]:
        """Every key in ``bucket``, as the server holds it (no mount cache in between)."""
        keys: list[str] = []
        token: Optional[str] = None
        while True:
            query = {"list-type": "2"}
            if token:
                query["continuation-token"] = token
            root = ET.fromstring(self._request("GET", f"/{bucket}?{urllib.parse.urlencode(query)}"))
            keys += [key.text or "" for key in root.iter(f"{_NS}Key")]
            token = root.findtext(f"{_NS}NextContinuationToken")
            if root.findtext(f"{_NS}IsTruncated") != "true" or not token:
                return keys

    def delete_bucket(self, bucket: str) -> None:
        """Delete every object in ``bucket``, then the bucket."""
        for key in self.list_objects(bucket):
            self._request("DELETE", f"/{bucket}/{urllib.parse.quote(key, safe='/~')}")
        self._request("DELETE", f"/{bucket}")

    def _request(self, method: str, target: str) -> bytes:
        if not self.endpoint:
            raise S3Error(f"S3 server not started ({method} {target})")
        request = urllib.request.Request(self.endpoint + target, method=method, headers={"Authorization": _AUTH})
        try:
            with _opener.open(request, timeout=_HTTP_TIMEOUT) as response:
                body: bytes = response.read()
                return body
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode(errors="replace")
            raise S3Error(f"S3 {method} {target} at {self.endpoint}: HTTP {exc.code} {detail}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise S3Error(f"S3 {method} {target} at {self.endpoint}: {exc}") from exc


_shared: Optional[S3Server] = None
_shared_lock = threading.Lock()


def shared_s3_server() -> S3Server:
    """The process's S3 server, started on first use (again if it died), stopped at exit."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.is_running():
            if _shared is not None:
                log.warning("the shared S3 server died; starting a new one:\n%s", _shared.log()[-2000:])
                _shared.stop()
            _shared = S3Server().start()
        return _shared


def stop_shared_s3_server() -> None:
    """Stop the shared S3 server if one runs (mounts on it must be stopped first)."""
    global _shared
    with _shared_lock:
        server, _shared = _shared, None
    if server is not None:
        server.stop()


atexit.register(stop_shared_s3_server)
