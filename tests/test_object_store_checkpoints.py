"""Reading, pruning and recovering checkpoints committed to an object store (s3:// on moto's
real S3 server, 127.0.0.1), with the promises they keep on paths: ``latest_complete`` is one
paginated LIST plus one GET and never names a step whose objects no longer match its commit
object; ``verify`` (deep too) says why a checkpoint is not complete; retention never removes the
resume point nor a name its pattern does not take; ``recover`` re-uploads a kept copy."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _stores import Requests, new_bucket
from safetensors.numpy import save_file

import safestage
from safestage import COMMIT_NAME, _object_store
from safestage import cli as _cli
from safestage._destination import ObjectURL
from safestage.testing._s3 import shared_s3_server


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    yield new_bucket(monkeypatch, "ckpts")
    _object_store.after_fork_in_child()  # no client of this test's environment outlives it


def commit(url: str, root: Path, step: int, *, size: int = 64) -> None:
    with safestage.staged_dir(url, root) as local:
        save_file({"w": np.full(size, step, dtype=np.float32)}, str(local / "model.safetensors"))
        (local / "trainer_state.json").write_text(json.dumps({"step": step}))


def run_of(bucket: str, root: Path, steps: tuple[int, ...] = (1, 2, 3)) -> str:
    run = f"s3://{bucket}/run"
    for step in steps:
        commit(f"{run}/checkpoint-{step}", root, step)
    return run


def keys(bucket: str) -> list[str]:
    return shared_s3_server().list_objects(bucket)


def url(text: str) -> ObjectURL:
    found = safestage._destination.url_of(text)
    assert found is not None
    return found


def test_latest_of_a_run_url_is_one_list_and_one_get_of_the_newest_commit_object(bucket: str, root: Path) -> None:
    run = run_of(bucket, root)
    with Requests(bucket) as seen:
        found = safestage.latest_complete(run)
    assert found == url(f"{run}/checkpoint-3")
    assert len(seen.lists()) == 1 and seen.gets() == [f"/{bucket}/run/checkpoint-3/{COMMIT_NAME}"], seen.made
    assert len(seen.made) == 2, seen.made


def test_a_second_page_of_the_listing_is_one_more_list_and_latest_is_still_right(bucket: str, root: Path) -> None:
    run = run_of(bucket, root, (1, 2))
    # 1,001 objects sorting before the checkpoints: S3 lists 1,000 keys a page, so every
    # checkpoint's key is on the second page.
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: _object_store.put_bytes(url(f"{run}/aaa-logs/{i:04d}.txt"), b"x"), range(1001)))
    with Requests(bucket) as seen:
        found = safestage.latest_complete(run)
    assert found == url(f"{run}/checkpoint-2")
    assert len(seen.lists()) == 2 and "continuation-token" in seen.lists()[1], seen.made
    assert seen.gets() == [f"/{bucket}/run/checkpoint-2/{COMMIT_NAME}"]


def test_an_object_overwritten_after_its_commit_is_not_complete_and_latest_falls_back(
    bucket: str, root: Path, caplog: Any
) -> None:
    """A stale writer of step 3 uploads its model.safetensors after step 3 was committed (same
    size, other bytes): the listing's ETag is not the commit object's."""
    run = run_of(bucket, root)
    stale = url(f"{run}/checkpoint-3/model.safetensors")
    before = _object_store.head(stale)
    with root.joinpath("stale.safetensors").open("wb"):
        pass
    save_file({"w": np.full(64, 99, dtype=np.float32)}, str(root / "stale.safetensors"))
    _object_store.upload(root / "stale.safetensors", stale)
    after = _object_store.head(stale)
    assert before is not None and after is not None and before.size == after.size and before.etag != after.etag

    with caplog.at_level(logging.INFO, logger="safestage"):
        assert safestage.latest_complete(run) == url(f"{run}/checkpoint-2")
    assert "checkpoint-3" in caplog.text and "changed" in caplog.text
    result = safestage.verify(f"{run}/checkpoint-3")
    assert not result.complete and [(p.path, p.kind) for p in result.problems] == [("model.safetensors", "changed")]
    assert safestage.verify(f"{run}/checkpoint-2").complete


def test_a_missing_object_or_a_deleted_commit_object_makes_latest_fall_back(bucket: str, root: Path) -> None:
    run = run_of(bucket, root)
    _object_store.delete([url(f"{run}/checkpoint-3/trainer_state.json")])
    assert safestage.latest_complete(run) == url(f"{run}/checkpoint-2")
    problems = safestage.verify(f"{run}/checkpoint-3").problems
    assert [(p.path, p.kind) for p in problems] == [("trainer_state.json", "missing")]

    _object_store.delete([url(f"{run}/checkpoint-2/{COMMIT_NAME}")])
    with Requests(bucket) as seen:
        assert safestage.latest_complete(run) == url(f"{run}/checkpoint-1")
    # checkpoint-2 has no commit object in the listing: it costs no request.
    assert len(seen.lists()) == 1 and [g.split("/")[3] for g in seen.gets()] == ["checkpoint-3", "checkpoint-1"]
    assert [p.kind for p in safestage.verify(f"{run}/checkpoint-2").problems] == ["no-commit"]
    assert [p.kind for p in safestage.verify(f"{run}/checkpoint-9").problems] == ["not-a-directory"]


def test_deep_verify_streams_every_object_back_and_checks_its_crc(bucket: str, root: Path) -> None:
    run = run_of(bucket, root, (1,))
    ckpt = f"{run}/checkpoint-1"
    result = safestage.verify(ckpt, deep=True)
    assert result.complete and result.bytes_read == result.manifest.total_bytes > 0, result  # type: ignore[union-attr]
    # A commit object recording another CRC-32 for the same size and ETag: only the bytes can say.
    manifest = json.loads(_object_store.read(url(f"{ckpt}/{COMMIT_NAME}")) or b"")
    for entry in manifest["files"]:
        if entry["path"] == "model.safetensors":
            entry["digest"] = "00000000" if entry["digest"] != "00000000" else "00000001"
    _object_store.delete([url(f"{ckpt}/{COMMIT_NAME}")])
    _object_store.put_bytes(url(f"{ckpt}/{COMMIT_NAME}"), json.dumps(manifest).encode(), create=True)
    assert safestage.verify(ckpt).complete
    deep = safestage.verify(ckpt, deep=True)
    assert [(p.path, p.kind) for p in deep.problems] == [("model.safetensors", "digest")]
    _object_store.put_bytes(url(f"{ckpt}/extra.txt"), b"not committed")
    assert safestage.verify(ckpt, deep=True).extra == ["extra.txt"]


def test_the_commands_take_a_url_and_name_it_when_the_store_refuses(bucket: str, root: Path, capsys: Any) -> None:
    run = run_of(bucket, root, (1, 2))
    assert _cli.main(["latest", run]) == 0
    assert capsys.readouterr().out.strip() == f"{run}/checkpoint-2"
    assert _cli.main(["verify", f"{run}/checkpoint-2", "--deep"]) == 0
    assert "complete: 2 files" in capsys.readouterr().out
    _object_store.delete([url(f"{run}/checkpoint-2/model.safetensors")])
    assert _cli.main(["verify", f"{run}/checkpoint-2"]) == 1
    assert "model.safetensors: missing" in capsys.readouterr().out
    assert _cli.main(["latest", run, "--pattern", "step-*"]) == 1
    assert "checkpoint-1" in capsys.readouterr().err  # what the pattern does not take is named

    missing = f"s3://{bucket}-missing/run"
    assert _cli.main(["latest", missing]) == 3
    err = capsys.readouterr().err
    assert missing.replace("/run", "") in err and "list" in err and "testing" not in err, err  # no secret
    assert _cli.main(["verify", f"{missing}/checkpoint-1"]) == 1
    assert "list" in capsys.readouterr().out
