"""GCS's XML API, as obstore speaks it, in front of fake-gcs-server's JSON API.

obstore (Rust object_store) reaches GCS through the XML API; fake-gcs-server serves the JSON
API (and XML GET/HEAD only). :class:`GcsXmlFront` is an HTTP server on 127.0.0.1 (a thread of
the test process, like the FaultProxy) that answers each XML request obstore sends with calls
to the JSON API:

- ``PUT /bucket/key``: one upload (``uploadType=multipart``: fake-gcs-server honours
  ``ifGenerationMatch`` there, not on ``uploadType=media``); ``x-goog-if-generation-match: N``
  becomes ``ifGenerationMatch=N``, and a refusal is GCS's 412 PreconditionFailed;
- ``GET``/``HEAD /bucket/key`` (``Range``; ``If-Match`` with an ETag, and
  ``x-goog-if-generation-match``, checked here against the one answer fake-gcs-server gives);
- ``DELETE /bucket/key`` (obstore deletes one object a request on GCS: it has no bulk delete);
- ``GET /bucket?list-type=2`` (``prefix``, ``delimiter``, ``continuation-token``,
  ``max-keys``, 1,000 keys a page by default as GCS): a ListBucketResult;
- multipart uploads: ``POST ?uploads``, ``PUT ?partNumber=&uploadId=``, ``POST ?uploadId=``
  (the parts, held in this process's memory, assembled and uploaded once, with the initiate's
  precondition), ``DELETE ?uploadId=`` (the parts dropped).

Answers carry what GCS's XML API answers with: ``ETag`` (the quoted hex MD5 of the object),
``x-goog-generation``, ``Last-Modified``, errors as ``<Error><Code>``. Not emulated (a real bucket
shows them): a multipart object's ETag (GCS's is not an MD5; here it is), uploads in parts
outliving the process, a precondition racing another writer inside GCS, GCS's own throttling.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import socket
import threading
import urllib.parse
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from xml.sax.saxutils import escape

_TIMEOUT = 120.0
_MESSAGES = {
    400: ("InvalidArgument", "Invalid argument."),
    404: ("NoSuchKey", "The specified key does not exist."),
    412: ("PreconditionFailed", "At least one of the pre-conditions you specified did not hold."),
}


@dataclass
class _Upload:
    bucket: str
    key: str
    generation_match: Optional[str]  # the initiate's x-goog-if-generation-match
    parts: dict[int, bytes] = field(default_factory=dict)


class _Answer(Exception):
    """An XML error answer (status, GCS's code)."""

    def __init__(self, status: int, code: Optional[str] = None) -> None:
        super().__init__(status)
        self.status = status
        self.code = code or _MESSAGES.get(status, ("InternalError", ""))[0]


class GcsXmlFront:
    """The XML front on ``endpoint`` (``http://127.0.0.1:<port>``) of fake-gcs-server at ``upstream``."""

    def __init__(self, upstream: str) -> None:
        parts = urllib.parse.urlsplit(upstream)
        assert parts.hostname and parts.port, upstream
        self._target = (parts.hostname, parts.port)
        self._uploads: dict[str, _Upload] = {}
        self._lock = threading.Lock()
        self._server: Optional[ThreadingHTTPServer] = None
        self.endpoint = ""

    def start(self) -> GcsXmlFront:
        front = self

        class Handler(_Handler):
            owner = front

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="safestage-gcs-front", daemon=True).start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def is_running(self) -> bool:
        return self._server is not None

    def uploads_in_flight(self, bucket: str) -> list[str]:
        """The keys of the multipart uploads in ``bucket`` neither completed nor aborted."""
        with self._lock:
            return sorted(u.key for u in self._uploads.values() if u.bucket == bucket)

    # -- the JSON API ------------------------------------------------------------------------------

    def json(self, method: str, target: str, body: bytes = b"", headers: Optional[Mapping[str, str]] = None
             ) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
        connection = http.client.HTTPConnection(*self._target, timeout=_TIMEOUT)
        try:
            connection.request(method, target, body=body or None, headers=dict(headers or {}))
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            connection.close()

    def upload(self, bucket: str, key: str, data: bytes, generation_match: Optional[str]) -> dict[str, str]:
        """One upload of ``data``; the object's XML headers. A single-request upload with
        metadata: fake-gcs-server checks ifGenerationMatch there only."""
        boundary = uuid.uuid4().hex
        body = b"".join([
            f"--{boundary}\r\nContent-Type: application/json\r\n\r\n".encode(), json.dumps({"name": key}).encode(),
            f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(), data,
            f"\r\n--{boundary}--\r\n".encode(),
        ])  # fmt: skip
        query = {"uploadType": "multipart"}
        if generation_match is not None:
            query["ifGenerationMatch"] = generation_match
        status, _, answer = self.json("POST", f"/upload/storage/v1/b/{_q(bucket)}/o?{urllib.parse.urlencode(query)}",
                                      body, {"Content-Type": f"multipart/related; boundary={boundary}"})  # fmt: skip
        if status != 200:
            raise _Answer(status, "NoSuchBucket" if status == 404 else None)
        meta = json.loads(answer)
        return {"ETag": _etag(meta["md5Hash"]), "x-goog-generation": str(meta["generation"])}


class _Handler(BaseHTTPRequestHandler):
    owner: GcsXmlFront
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in two writes: without this, Nagle's algorithm holds the body
        # until the client's delayed ACK (40 ms a GET).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _dispatch(self) -> None:
        split = urllib.parse.urlsplit(self.path)
        bucket, _, key = urllib.parse.unquote(split.path).lstrip("/").partition("/")
        query = {k: v[0] for k, v in urllib.parse.parse_qs(split.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        try:
            status, headers, answer = self._answer(self.command, bucket, key, query, body)
        except _Answer as exc:
            message = _MESSAGES.get(exc.status, ("", "The front of fake-gcs-server failed."))[1]
            status, headers = exc.status, {"Content-Type": "application/xml; charset=UTF-8"}
            answer = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{exc.code}</Code>"
                      f"<Message>{message}</Message></Error>").encode()  # fmt: skip
        headers.setdefault("Content-Length", str(len(answer)))
        try:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(answer)
        except (BrokenPipeError, ConnectionResetError):  # a client that stopped reading (a cancelled GET)
            self.close_connection = True

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _dispatch

    def _answer(self, method: str, bucket: str, key: str, query: dict[str, str], body: bytes
                ) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
        front = self.owner
        match = self.headers.get("x-goog-if-generation-match")
        if not key and method == "GET" and query.get("list-type") == "2":
            return self._list(bucket, query)
        if method == "PUT" and "uploadId" in query:
            with front._lock:
                upload = front._uploads.get(query["uploadId"])
                if upload is None:
                    raise _Answer(404, "NoSuchUpload")
                upload.parts[int(query["partNumber"])] = body
            return 200, {"ETag": _etag(base64.b64encode(hashlib.md5(body).digest()).decode())}, b""
        if method == "PUT":
            return 200, front.upload(bucket, key, body, match), b""
        if method == "POST" and "uploads" in query:
            upload_id = uuid.uuid4().hex
            with front._lock:
                front._uploads[upload_id] = _Upload(bucket, key, match)
            return 200, {"Content-Type": "application/xml"}, (
                f"<?xml version='1.0' encoding='UTF-8'?><InitiateMultipartUploadResult><Bucket>{escape(bucket)}"
                f"</Bucket><Key>{escape(key)}</Key><UploadId>{upload_id}</UploadId></InitiateMultipartUploadResult>"
            ).encode()  # fmt: skip
        if method == "POST" and "uploadId" in query:
            return self._complete(query["uploadId"], body)
        if method == "DELETE" and "uploadId" in query:
            with front._lock:
                front._uploads.pop(query["uploadId"], None)
            return 204, {}, b""
        if method == "DELETE":
            status, _, _ = front.json("DELETE", f"/storage/v1/b/{_q(bucket)}/o/{_q(key)}")
            if status not in (200, 204):
                raise _Answer(status)
            return 204, {}, b""
        if method in ("GET", "HEAD") and key:
            return self._get(method, bucket, key, match)
        raise _Answer(400)

    def _get(self, method: str, bucket: str, key: str, generation: Optional[str]) -> tuple[int, dict[str, str], bytes]:
        headers = {"Range": self.headers["Range"]} if self.headers.get("Range") and method == "GET" else {}
        status, got, answer = self.owner.json(method, f"/storage/v1/b/{_q(bucket)}/o/{_q(key)}?alt=media", headers=headers)
        if status not in (200, 206):
            raise _Answer(status)
        md5 = dict(p.split("=", 1) for p in got.get("x-goog-hash", "").split(",") if "=" in p)["md5"]
        etag = _etag(md5)
        # fake-gcs-server ignores both on a download: checked here, on the answer it gave.
        if_match = self.headers.get("If-Match")
        if (if_match is not None and if_match not in ("*", etag)) or generation not in (None, got["x-goog-generation"]):
            raise _Answer(412)
        headers = {"ETag": etag, "x-goog-generation": got["x-goog-generation"], "Last-Modified": got["last-modified"],
                   "Content-Type": "application/octet-stream", "Content-Length": got["content-length"]}  # fmt: skip
        if "content-range" in got:
            headers["Content-Range"] = got["content-range"]
        return status, headers, answer

    def _list(self, bucket: str, query: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        wanted = {"prefix": query.get("prefix"), "delimiter": query.get("delimiter"),
                  "pageToken": query.get("continuation-token"), "maxResults": query.get("max-keys", "1000"),
                  "startOffset": query.get("start-after")}  # fmt: skip
        target = f"/storage/v1/b/{_q(bucket)}/o?" + urllib.parse.urlencode({k: v for k, v in wanted.items() if v})
        status, _, answer = self.owner.json("GET", target)
        if status != 200:
            raise _Answer(status, "NoSuchBucket" if status == 404 else None)
        page = json.loads(answer)
        after = query.get("start-after")
        rows = [f"<Contents><Key>{escape(o['name'])}</Key><Size>{o['size']}</Size><LastModified>{o['updated']}"
                f"</LastModified><ETag>{escape(_etag(o['md5Hash']))}</ETag></Contents>"
                for o in page.get("items", []) if after is None or o["name"] > after]  # fmt: skip
        rows += [f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>" for p in page.get("prefixes", [])]
        token = page.get("nextPageToken")
        text = (f"<?xml version='1.0' encoding='UTF-8'?><ListBucketResult><Name>{escape(bucket)}</Name>"
                f"<Prefix>{escape(query.get('prefix', ''))}</Prefix><KeyCount>{len(rows)}</KeyCount>"
                f"<IsTruncated>{'true' if token else 'false'}</IsTruncated>{''.join(rows)}"
                + (f"<NextContinuationToken>{escape(token)}</NextContinuationToken>" if token else "")
                + "</ListBucketResult>")  # fmt: skip
        return 200, {"Content-Type": "application/xml"}, text.encode()

    def _complete(self, upload_id: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        front = self.owner
        with front._lock:
            upload = front._uploads.get(upload_id)
        if upload is None:
            raise _Answer(404, "NoSuchUpload")
        pieces = []
        for part in ET.fromstring(body).iter("Part"):
            data = upload.parts.get(int(part.findtext("PartNumber") or 0))
            etag = (part.findtext("ETag") or "").strip()
            if data is None or etag != _etag(base64.b64encode(hashlib.md5(data).digest()).decode()):
                raise _Answer(400, "InvalidPart")
            pieces.append(data)
        headers = front.upload(upload.bucket, upload.key, b"".join(pieces), upload.generation_match)
        with front._lock:
            front._uploads.pop(upload_id, None)
        return 200, {**headers, "Content-Type": "application/xml"}, (
            f"<?xml version='1.0' encoding='UTF-8'?><CompleteMultipartUploadResult><Bucket>{escape(upload.bucket)}"
            f"</Bucket><Key>{escape(upload.key)}</Key><ETag>{escape(headers['ETag'])}</ETag>"
            "</CompleteMultipartUploadResult>"
        ).encode()  # fmt: skip


def _q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def _etag(md5_base64: str) -> str:
    """GCS XML's ETag of an object: its MD5 in hex, quoted (the JSON API gives it in base64)."""
    return f'"{base64.b64decode(md5_base64).hex()}"'

