"""Local S3 servers: moto in its own process (the real mounts' and the tests'), and the S3
side of the kit's object stores (:class:`S3Store`, which seaweedfs shares).

One moto per process is shared by every S3 mount (:func:`shared_s3_server`): moto takes
seconds to import, buckets keep mounts apart, and a bucket must outlive a remount. It is
stopped at interpreter exit or by :func:`stop_shared_s3_server`; the supervisor stops it if
the process dies first. The kit's own requests (bucket create/list/delete, the multipart
uploads in flight) use urllib, signed with SigV4: no boto3 in the caller's process.

moto honours what safestage asks of S3: conditional create (``If-None-Match: *``, 412 when the
key exists), multipart uploads and their abort, ListObjectsV2 pages and batched deletes. It
does not check signatures; seaweedfs (``_seaweedfs``) does.
"""

from __future__ import annotations

import re
import sys
import urllib.parse
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import ClassVar, Optional

from ._signing import sigv4_headers
from ._stores import (
    START_TIMEOUT,
    ObjectStoreUnavailable,
    StoreRequestError,
    SupervisedServer,
    http_request,
    shared_server,
    stop_shared_object_stores,
)

_SERVER_SCRIPT = Path(__file__).with_name("_s3_server.py")
_EXIT_NO_MOTO = 3  # keep in sync with _s3_server.EXIT_NO_MOTO
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # werkzeug colours its access log even into a file

ACCESS_KEY = "safestage"  # moto accepts any credentials; seaweedfs is configured with these
SECRET_KEY = "safestage-secret"
REGION = "us-east-1"

MOTO_HINT = "install it into this interpreter: pip install 'moto[server]' (safestage pins it in .ci/constraints-real.txt)"


class S3Error(StoreRequestError):
    """A request of the kit to a local S3 server failed."""


class S3Store(SupervisedServer):
    """An S3 server of the kit: signed bucket requests, the AWS environment, multipart uploads."""

    scheme: ClassVar[str] = "s3"

    def environment(self, bucket: str, *, endpoint: Optional[str] = None) -> dict[str, str]:
        """What a user sets for a real bucket: obstore (and boto3, the AWS CLI) read these."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_ALLOW_HTTP": "true",
        }

    def create_bucket(self, bucket: str) -> None:
        self._request("PUT", f"/{bucket}")

    def list_objects(self, bucket: str) -> list[str]:
        """Every key in ``bucket``, as the server holds it (no client or mount cache between)."""
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
                return sorted(keys)

    def uploads_in_flight(self, bucket: str) -> list[str]:
        """The keys of the multipart uploads begun and neither completed nor aborted
        (ListMultipartUploads), sorted; one entry per upload."""
        root = ET.fromstring(self._request("GET", f"/{bucket}?uploads="))
        return sorted(upload.findtext(f"{_NS}Key") or "" for upload in root.iter(f"{_NS}Upload"))

    def put_object(self, bucket: str, key: str, body: bytes = b"") -> None:
        """Put ``body`` at ``key`` as the server names it: a key ending in "/" too (a folder
        marker, as the S3 console and s3fs make them), which obstore cannot name."""
        self._request("PUT", f"/{bucket}/{_quote(key)}", body)

    def begin_upload(self, bucket: str, key: str, part: bytes = b"a part") -> str:
        """Begin a multipart upload of ``key`` and upload one ``part`` of it, never completed:
        what a writer killed during its upload leaves. Returns its upload id."""
        root = ET.fromstring(self._request("POST", f"/{bucket}/{_quote(key)}?uploads="))
        upload_id = root.findtext(f"{_NS}UploadId") or ""
        query = urllib.parse.urlencode({"partNumber": "1", "uploadId": upload_id})
        self._request("PUT", f"/{bucket}/{_quote(key)}?{query}", part)
        return upload_id

    def delete_bucket(self, bucket: str) -> None:
        """Abort its multipart uploads, delete every object in ``bucket``, then the bucket."""
        root = ET.fromstring(self._request("GET", f"/{bucket}?uploads="))
        for upload in root.iter(f"{_NS}Upload"):
            key, upload_id = upload.findtext(f"{_NS}Key") or "", upload.findtext(f"{_NS}UploadId") or ""
            self._request("DELETE", f"/{bucket}/{_quote(key)}?{urllib.parse.urlencode({'uploadId': upload_id})}")
        for key in self.list_objects(bucket):
            self._request("DELETE", f"/{bucket}/{_quote(key)}")
        self._request("DELETE", f"/{bucket}")

    def _request(self, method: str, target: str, body: bytes = b"") -> bytes:
        if not self.endpoint:
            raise S3Error(f"{self.name} not started ({method} {target})")
        url = self.endpoint + target
        # An explicit type: urllib would send a body as application/x-www-form-urlencoded, which
        # moto tries to parse as a form (a 500 on UploadPart).
        typed = {"Content-Type": "application/octet-stream"} if body else None
        headers = sigv4_headers(method, url, access_key=ACCESS_KEY, secret_key=SECRET_KEY, region=REGION, body=body,
                                headers=typed)  # fmt: skip
        try:
            return http_request(method, url, headers=headers, body=body, what=f"{self.name} at {self.endpoint}")
        except StoreRequestError as exc:
            raise S3Error(str(exc), status=exc.status) from exc

    def _answers(self) -> bool:
        """Whether the S3 API answers a signed ListBuckets."""
        try:
            self._request("GET", "/")
        except S3Error as exc:
            if exc.status is not None:
                raise  # it answers, but refuses the kit: a misconfiguration, said at once
            return False
        return True


def _quote(key: str) -> str:
    return urllib.parse.quote(key, safe="/~")


class S3Server(S3Store):
    """moto's S3 on ``endpoint`` (``http://127.0.0.1:<free port>``), data in memory."""

    kind: ClassVar[str] = "moto"
    name: ClassVar[str] = "the S3 server (moto)"
    install_hint: ClassVar[str] = MOTO_HINT

    def __init__(self, *, timeout: float = START_TIMEOUT) -> None:
        super().__init__(timeout=timeout)

    def _command(self, ctl: Path) -> list[str]:
        return [sys.executable, str(_SERVER_SCRIPT), "--port-file", str(ctl / "port")]

    def _probe(self) -> Optional[str]:
        assert self._ctl is not None
        try:
            port = int((self._ctl / "port").read_text(encoding="ascii"))
        except (FileNotFoundError, ValueError):
            return None
        self.endpoint = f"http://127.0.0.1:{port}"
        # ListBuckets: the app answers, not just the socket.
        return self.endpoint if self._answers() else None

    def _exited(self, code: int, text: str) -> Optional[BaseException]:
        if code == _EXIT_NO_MOTO:
            return ObjectStoreUnavailable(f"moto is not installed in {sys.executable}: {MOTO_HINT}\n{text}")
        return None

    def log(self) -> str:
        """The server's output: moto's access log, one line per request, with times."""
        return _ANSI.sub("", super().log())


def shared_s3_server() -> S3Server:
    """The process's moto S3 server, started on first use (again if it died), stopped at exit."""
    server = shared_server("moto", S3Server)
    assert isinstance(server, S3Server)
    return server


def stop_shared_s3_server() -> None:
    """Stop the shared moto S3 server if one runs (mounts on it must be stopped first)."""
    stop_shared_object_stores(["moto"])
