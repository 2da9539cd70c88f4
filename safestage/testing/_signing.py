"""Request signing for the kit's own requests to its local stores: AWS SigV4 (the library's,
``safestage._sigv4``) and Azure Shared Key.

The kit creates, lists and deletes buckets with urllib (no boto3, no Azure SDK in the caller's
process). moto accepts any signature, but seaweedfs and Azurite check them, so the kit signs
like a real client would. Standard library only; each function returns the headers to send.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import urllib.parse
from collections.abc import Mapping
from typing import Optional

from .._sigv4 import sigv4_headers

__all__ = ["shared_key_headers", "sigv4_headers"]


def shared_key_headers(
    method: str,
    url: str,
    *,
    account: str,
    key: str,
    body: bytes = b"",
    headers: Optional[Mapping[str, str]] = None,
    version: str = "2021-08-06",
) -> dict[str, str]:
    """The headers of an Azure Blob request signed with the account's Shared Key.

    The URL is path-style (``http://127.0.0.1:PORT/<account>/<container>``), as Azurite serves
    it; the canonical resource then names the account twice, as Azure's docs say for emulators.
    """
    parts = urllib.parse.urlsplit(url)
    signed = {name.lower(): value for name, value in (headers or {}).items()}
    signed.setdefault("x-ms-date", email.utils.formatdate(usegmt=True))
    signed.setdefault("x-ms-version", version)
    # An explicit type: urllib would add application/x-www-form-urlencoded after signing.
    signed.setdefault("content-type", "application/octet-stream")
    fields = [
        method,
        signed.get("content-encoding", ""),
        signed.get("content-language", ""),
        str(len(body)) if body else "",
        signed.get("content-md5", ""),
        signed.get("content-type", ""),
        "",  # Date: x-ms-date is used instead
        signed.get("if-modified-since", ""),
        signed.get("if-match", ""),
        signed.get("if-none-match", ""),
        signed.get("if-unmodified-since", ""),
        signed.get("range", ""),
    ]
    canonical_headers = "".join(f"{name}:{signed[name].strip()}\n" for name in sorted(signed) if name.startswith("x-ms-"))
    resource = f"/{account}{urllib.parse.unquote(parts.path)}"
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    for name in sorted(query, key=str.lower):
        resource += f"\n{name.lower()}:{','.join(sorted(query[name]))}"
    to_sign = "\n".join(fields) + "\n" + canonical_headers + resource
    digest = hmac.new(base64.b64decode(key), to_sign.encode(), hashlib.sha256).digest()
    signed["authorization"] = f"SharedKey {account}:{base64.b64encode(digest).decode()}"
    return signed
