"""AWS Signature Version 4 for the S3 requests obstore has no call for (the multipart uploads a
killed writer left in flight: ``_s3_uploads``), and for the kit's own requests to its local S3
servers. Standard library only; returns the headers to send."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import urllib.parse
from collections.abc import Mapping
from typing import Optional

_UNRESERVED = "-_.~"


def _quote(text: str, safe: str = _UNRESERVED) -> str:
    return urllib.parse.quote(text, safe=safe)


def sigv4_headers(
    method: str,
    url: str,
    *,
    access_key: str,
    secret_key: str,
    region: str,
    body: bytes = b"",
    headers: Optional[Mapping[str, str]] = None,
    service: str = "s3",
) -> dict[str, str]:
    """The headers of a SigV4-signed S3 request (``Host`` left to the HTTP client).
    ``headers``: signed and returned too (``x-amz-security-token`` for temporary keys)."""
    parts = urllib.parse.urlsplit(url)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    day = stamp[:8]
    payload = hashlib.sha256(body).hexdigest()
    signed = {name.lower(): value for name, value in (headers or {}).items()}
    signed.update({"host": parts.netloc, "x-amz-date": stamp, "x-amz-content-sha256": payload})
    query = sorted(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    canonical_query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in query)
    names = sorted(signed)
    canonical_headers = "".join(f"{name}:{' '.join(signed[name].split())}\n" for name in names)
    signed_names = ";".join(names)
    # The path arrives percent-encoded already (the caller quoted the key): S3 signs it as sent.
    canonical = "\n".join([method, parts.path or "/", canonical_query, canonical_headers, signed_names, payload])
    scope = f"{day}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + secret_key).encode()
    for part in (day, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    signed["authorization"] = f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed_names}, Signature={signature}"
    del signed["host"]
    return signed
