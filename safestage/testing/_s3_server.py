"""Entry point of the local S3 server process: moto's S3 on 127.0.0.1, a free port, in memory.

Started by ``_s3.S3Server`` (under ``_supervise``) as ``python <this file> --port-file PATH``. It
binds 127.0.0.1 only (nothing may leave the machine), lets the kernel pick the port and writes
it to ``--port-file`` once the socket listens. Every request is logged to stderr (werkzeug's
access log), which is how tests and people see what a mount tool really sent, and when.

moto is imported here and only here: the caller's process stays free of it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterable
from typing import Any, Callable, Optional

log = logging.getLogger("safestage.testing")

# Exit status meaning "moto is not installed" (the kit turns it into RealMountUnavailable).
EXIT_NO_MOTO = 3

_Headers = list[tuple[str, str]]
_StartResponse = Callable[..., Any]


def _parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="safestage local S3 server (moto)")
    parser.add_argument("--port-file", required=True, help="where the chosen port is written")
    parser.add_argument("--host", default="127.0.0.1")
    return parser.parse_args(argv)


def drop_null_version_id(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """WSGI middleware: remove ``x-amz-version-id: null`` from responses.

    moto 5.2.5 sends that header on CompleteMultipartUpload in an unversioned bucket (its other
    responses check ``!= "null"``; this one does not). Real S3 sends no version id there.
    rclone 1.60.1 then reads the object back with ``HEAD ?versionId=null``, moto answers 400,
    and close() of every file above rclone's streaming cutoff fails with EIO ("WriteFileHandle
    .Flush error: BadRequest"): every large save onto rclone-s3 would fail for moto's sake.
    """

    def wrapped(environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        def fixed_start(status: str, headers: _Headers, exc_info: Any = None) -> Any:
            kept = [(k, v) for k, v in headers if not (k.lower() == "x-amz-version-id" and v == "null")]
            if len(kept) != len(headers):
                # Logged so that a test can check the fix really fired.
                log.info("dropped x-amz-version-id: null from %s %s", environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"))
            return start_response(status, kept, exc_info)

        return app(environ, fixed_start)

    return wrapped


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
    )
    try:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server
    except ImportError as exc:
        log.error("cannot import moto's server (pip install 'moto[server]'): %s", exc)
        return EXIT_NO_MOTO

    app = drop_null_version_id(DomainDispatcherApplication(create_backend_app))
    server = make_server(args.host, 0, app, threaded=True, request_handler=MotoRequestHandler)
    port = server.server_address[1]
    # Written only now that the socket listens, and atomically: the kit polls for this file.
    partial = f"{args.port_file}.partial"
    with open(partial, "w", encoding="ascii") as out:
        out.write(f"{port}\n")
    os.replace(partial, args.port_file)
    log.info("moto S3 listening on http://%s:%d", args.host, port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    # SIGTERM ends the server like Ctrl-C does (the supervisor forwards SIGTERM).
    import signal

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    sys.exit(main())
