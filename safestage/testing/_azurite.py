"""Azurite's Blob service: Azure Blob Storage for ``az://`` (a container is the bucket), on
127.0.0.1, data under the server's temporary directory.

The Blob service alone (``azurite-blob``, from npm: ``npm install azurite``, which needs
Node.js), on a port the kit picks (a lost race is retried), with Azurite's well-known
development account and key. Requests are checked with Shared Key as Azure checks them; the
kit signs its own (``_signing``). ``--disableProductStyleUrl``: the account is the first path
segment (``http://127.0.0.1:PORT/devstoreaccount1/<container>``), as a user's endpoint names it.

What it honours: conditional create (``If-None-Match: *`` answers 409 BlobAlreadyExists),
block uploads (Put Block, Put Block List) and their uncommitted blocks, listing pages, deletes.
Blob batch deletes are not served by Azurite (obstore then deletes one blob a request).
"""

from __future__ import annotations

import shutil
import urllib.parse
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import ClassVar, Optional

from ._signing import shared_key_headers
from ._stores import StoreRequestError, SupervisedServer, find_binary, free_port, http_request

AZURITE_HINT = "npm install --prefix <venv> azurite@3.37.0 (Node.js 18 or newer on PATH)"

# Azurite's development account: public, documented, the same on every machine.
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


class AzuriteServer(SupervisedServer):
    """Azurite's Blob service on ``endpoint`` (``http://127.0.0.1:<port>/devstoreaccount1``)."""

    kind: ClassVar[str] = "azurite"
    scheme: ClassVar[str] = "az"
    name: ClassVar[str] = "Azurite (azurite-blob)"
    install_hint: ClassVar[str] = AZURITE_HINT

    _port = 0

    def _command(self, ctl: Path) -> list[str]:
        azurite = self._need(find_binary("azurite-blob"), "azurite-blob")
        self._need(shutil.which("node"), "Node.js (node on PATH)")
        self._port = free_port()
        (ctl / "data").mkdir()
        return [
            azurite, "--blobHost", "127.0.0.1", "--blobPort", str(self._port),
            "--location", str(ctl / "data"), "--disableProductStyleUrl", "--disableTelemetry",
            "--skipApiVersionCheck", "--loose",
        ]  # fmt: skip

    def _probe(self) -> Optional[str]:
        self.endpoint = f"http://127.0.0.1:{self._port}/{ACCOUNT}"
        try:
            self._request("GET", "", {"comp": "list"})  # List Containers: the service answers
        except StoreRequestError as exc:
            if exc.status is not None:
                raise
            return None
        return self.endpoint

    def environment(self, bucket: str, *, endpoint: Optional[str] = None) -> dict[str, str]:
        """What a user sets for a storage account: obstore reads these."""
        return {
            "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": KEY,
            "AZURE_STORAGE_ENDPOINT": f"{endpoint}/{ACCOUNT}" if endpoint else self.endpoint,
            "AZURE_ALLOW_HTTP": "true",
        }

    def create_bucket(self, bucket: str) -> None:
        self._request("PUT", f"/{bucket}", {"restype": "container"})

    def list_objects(self, bucket: str) -> list[str]:
        return sorted(self._blobs(bucket, uncommitted=False))

    def uploads_in_flight(self, bucket: str) -> list[str]:
        """Blobs with blocks put and no block list committed yet (an upload in parts under way
        or cut short). Not seen: new blocks staged over a blob that exists already."""
        committed = set(self._blobs(bucket, uncommitted=False))
        return sorted(name for name in self._blobs(bucket, uncommitted=True) if name not in committed)

    def delete_bucket(self, bucket: str) -> None:
        self._request("DELETE", f"/{bucket}", {"restype": "container"})

    def _blobs(self, bucket: str, *, uncommitted: bool) -> list[str]:
        found: list[str] = []
        marker = ""
        while True:
            query = {"restype": "container", "comp": "list"}
            if uncommitted:
                query["include"] = "uncommittedblobs"
            if marker:
                query["marker"] = marker
            root = ET.fromstring(self._request("GET", f"/{bucket}", query))
            found += [blob.findtext("Name") or "" for blob in root.iter("Blob")]
            marker = root.findtext("NextMarker") or ""
            if not marker:
                return found

    def _request(self, method: str, path: str, query: dict[str, str], body: bytes = b"") -> bytes:
        url = f"{self.endpoint}{urllib.parse.quote(path, safe='/~')}?{urllib.parse.urlencode(query)}"
        headers = shared_key_headers(method, url, account=ACCOUNT, key=KEY, body=body)
        return http_request(method, url, headers=headers, body=body, what=f"{self.name} at {self.endpoint}")
