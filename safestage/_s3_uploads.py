"""The S3 multipart uploads a killed writer left in flight: list them under a prefix and abort
them, for retention (``checkpoint/_prune``).

A save killed during a multipart upload leaves the upload open: invisible to a LIST, billed for
its parts until someone aborts it (S3 keeps them forever unless a lifecycle rule says
otherwise). obstore (0.12) has no request for either, so these two are sent here, with the
standard library, signed with SigV4: ListMultipartUploads (``GET /bucket?uploads&prefix=``, page
by page) and AbortMultipartUpload (``DELETE /bucket/key?uploadId=``).

They are signed with the keys obstore itself would use: ``storage_options`` given for the bucket
(``configure_store``), else the standard environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``). Where
there are none (an instance role, web identity: credentials obstore fetches itself and does not
hand out), the uploads cannot be listed here: ``access`` says why, and the bucket's lifecycle
rule for incomplete multipart uploads is what removes them (docs/object-stores.md). Errors name
the URL, the operation and the store's answer, never a secret.
"""

from __future__ import annotations

import errno
import http.client
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from ._destination import ObjectURL
from ._sigv4 import sigv4_headers

# Uploads a ListMultipartUploads page asks for (S3's maximum; a store may send fewer).
PAGE_UPLOADS = 1000
# One request's limit: these are small (a page of uploads, an abort), and retention must not
# hang a commit's thread on a store that stopped answering.
TIMEOUT = 60.0


@dataclass(frozen=True)
class InFlight:
    """A multipart upload begun and neither completed nor aborted: its object's URL and its id."""

    url: ObjectURL
    upload_id: str


@dataclass(frozen=True)
class Access:
    """How to reach one bucket: its endpoint (path style, or the bucket's own host) and keys."""

    base: str  # every request's URL starts here: the bucket's root, no trailing "/"
    region: str
    access_key: Optional[str]
    secret_key: Optional[str] = None
    token: Optional[str] = None
    unsigned: bool = False
    verify_tls: bool = True
    request_payer: bool = False


class UploadRequestError(OSError):
    """A request of this module failed: ``errno``, and the store's answer as the message."""


def access(bucket: str, options: Mapping[str, Any], environ: Mapping[str, str]) -> Union[Access, str]:
    """How to reach ``bucket`` with the keys obstore would use (``options`` first, then the
    ``AWS_*`` environment), or, where that cannot be done here, why not (a sentence)."""
    config = _config(options, environ)
    region = config.get("region") or config.get("default_region") or "us-east-1"
    unsigned = _true(config.get("skip_signature"))
    key, secret = config.get("access_key_id"), config.get("secret_access_key")
    if not unsigned and not (key and secret):
        return ("its credentials are not static keys (no access_key_id and secret_access_key in "
                "storage_options nor AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment: "
                "an instance role or web identity, which obstore fetches itself)")  # fmt: skip
    endpoint = (config.get("endpoint") or "").rstrip("/")
    virtual = _true(config.get("virtual_hosted_style_request"))
    if not endpoint:
        endpoint = f"https://{bucket}.s3.{region}.amazonaws.com" if virtual else f"https://s3.{region}.amazonaws.com"
    # A virtual-hosted endpoint given is the bucket's own (obstore's rule); else path style.
    base = endpoint if virtual else f"{endpoint}/{urllib.parse.quote(bucket, safe='')}"
    client = options.get("client_options") or {}
    return Access(
        base=base,
        region=region,
        access_key=key,
        secret_key=secret,
        token=config.get("token") or config.get("session_token"),
        unsigned=unsigned,
        verify_tls=not _true(client.get("allow_invalid_certificates") if isinstance(client, Mapping) else None),
        request_payer=_true(config.get("request_payer")),
    )


def in_flight(where: ObjectURL, reach: Access) -> Iterator[InFlight]:
    """The multipart uploads in flight below ``where`` (its prefix), page by page
    (``PAGE_UPLOADS`` a request), each once."""
    marker: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    while True:
        query = {"uploads": "", "prefix": where.prefix if where.key else "", "max-uploads": str(PAGE_UPLOADS), **marker}
        root = _xml(_send("GET", reach, "", query, where, "list the multipart uploads below"))
        new, last = 0, ("", "")
        for upload in _children(root, "Upload"):
            key, upload_id = _text(upload, "Key"), _text(upload, "UploadId")
            if key is None or not upload_id:
                continue
            last = (key, upload_id)
            # A store that ignores the prefix would hand back the whole bucket's: only ours.
            if (where.key and not key.startswith(where.prefix)) or last in seen:
                continue
            seen.add(last)
            new += 1
            yield InFlight(ObjectURL(where.scheme, where.bucket, key), upload_id)
        if _text(root, "IsTruncated") != "true" or not new:
            return  # the last page, or one that brought nothing new: asking again would loop
        # S3 pages by key, then upload id, and names both markers; seaweedfs pages by upload id
        # alone, names only that marker, and lists nothing after a key-marker it was sent.
        next_key, next_id = _text(root, "NextKeyMarker"), _text(root, "NextUploadIdMarker") or last[1]
        marker = {"key-marker": next_key, "upload-id-marker": next_id} if next_key else {"upload-id-marker": next_id}


def abort(upload: InFlight, reach: Access) -> None:
    """Abort ``upload``: its parts are deleted and it can no longer complete. One that is no
    longer in flight (completed or aborted since it was listed) is no error."""
    try:
        _send("DELETE", reach, upload.url.key, {"uploadId": upload.upload_id}, upload.url,
              "abort the multipart upload of")  # fmt: skip
    except UploadRequestError as exc:
        if exc.errno != errno.ENOENT or "NoSuchBucket" in str(exc):
            raise


# -- requests --------------------------------------------------------------------------------------


def _send(method: str, reach: Access, key: str, query: Mapping[str, str], url: ObjectURL, operation: str) -> bytes:
    quoted = "/" + urllib.parse.quote(key, safe="/-_.~") if key else "/"
    encoded = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(query.items()))
    target = f"{reach.base}{quoted}?{encoded}" if encoded else f"{reach.base}{quoted}"
    headers = {"x-amz-request-payer": "requester"} if reach.request_payer else {}
    if reach.token:
        headers["x-amz-security-token"] = reach.token
    if not reach.unsigned:
        assert reach.access_key and reach.secret_key
        headers = sigv4_headers(method, target, access_key=reach.access_key, secret_key=reach.secret_key,
                                region=reach.region, headers=headers)  # fmt: skip
    request = urllib.request.Request(target, method=method, headers=headers)
    context = None if reach.verify_tls else ssl._create_unverified_context()  # the user's client_options
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT, context=context) as answer:
            return bytes(answer.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()
        code, message = _error_of(body)
        raise UploadRequestError(
            _errno_of(exc.code, code),
            f"could not {operation} {url}: {exc.code} {code or exc.reason}{': ' + message if message else ''}",
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise UploadRequestError(errno.EIO, f"could not {operation} {url}: {reason}") from None
    except (http.client.HTTPException, ValueError) as exc:  # an answer cut short or malformed
        raise UploadRequestError(errno.EIO, f"could not {operation} {url}: the store's answer was "
                                 f"unreadable ({type(exc).__name__}: {exc})") from None  # fmt: skip


def _errno_of(status: int, code: Optional[str]) -> int:
    if status in (401, 403):
        return errno.EACCES
    if status == 404:
        return errno.ENOENT  # NoSuchUpload, NoSuchBucket: the caller tells them apart
    if status == 501 or code == "NotImplemented":
        return errno.EOPNOTSUPP
    return errno.EIO


def _error_of(body: bytes) -> tuple[Optional[str], Optional[str]]:
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return None, None
    return _text(root, "Code"), _text(root, "Message")


def _quote(text: str) -> str:
    return urllib.parse.quote(text, safe="-_.~")


# -- answers ---------------------------------------------------------------------------------------


def _xml(body: bytes) -> ET.Element:
    try:
        return ET.fromstring(body)
    except ET.ParseError as exc:
        raise UploadRequestError(errno.EIO, f"the store answered no XML: {body[:200]!r}") from exc


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]  # S3 answers in its namespace; some S3-compatible stores in none


def _children(element: ET.Element, name: str) -> list[ET.Element]:
    return [child for child in element if _local(child.tag) == name]


def _text(element: ET.Element, name: str) -> Optional[str]:
    for child in element:
        if _local(child.tag) == name:
            return child.text or ""
    return None


# -- configuration ---------------------------------------------------------------------------------

# obstore's names for the S3 keys this module needs (object_store's AmazonS3ConfigKey), each with
# its aliases: an "aws_" prefix is optional, and the environment spells them upper case.
_ALIASES = {
    "access_key_id": "access_key_id",
    "secret_access_key": "secret_access_key",
    "session_token": "token",
    "token": "token",
    "region": "region",
    "default_region": "default_region",
    "endpoint": "endpoint",
    "endpoint_url": "endpoint",
    "virtual_hosted_style_request": "virtual_hosted_style_request",
    "skip_signature": "skip_signature",
    "request_payer": "request_payer",
}
_AWS = re.compile(r"^aws_")


def _config(options: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, str]:
    """The keys obstore reads: the environment's ``AWS_*``, then ``options`` over them."""
    config: dict[str, str] = {}
    for source, prefixed_only in ((environ, True), (options, False)):
        for name, value in source.items():
            lowered = name.lower()
            if prefixed_only and not lowered.startswith("aws_"):
                continue
            wanted = _ALIASES.get(_AWS.sub("", lowered))
            if wanted is not None and value is not None and not isinstance(value, Mapping):
                config[wanted] = str(value)
    return config


def _true(value: object) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on") if value is not None else False
