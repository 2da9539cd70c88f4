"""safestage.transformers.CommitCallback with the real transformers Trainer (issue 12).

Two ranks (torch.distributed, gloo, CPU) train a tiny Llama built from a config, staged by the
environment only (SAFESTAGE_DIR, SAFESTAGE_TORCH_SAVE=1), saving every 2 steps into a run
directory on the kit's hdfs and mountpoint FUSE mounts (``_trainer_run.py``, the recipe of
docs/checkpoints.md). The first run is SIGKILLed (its whole process group) as soon as its third
checkpoint directory appears, while it is being written; the same script then runs again and
resumes from ``safestage.latest_complete``.

The ranks are started here, not by torchrun: torchrun puts its workers in sessions of their
own, and the kill must reach every rank at once, as a preemption does.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from _helpers import files_under, fresh_dir, stray_files
from _support import tiered
from safetensors.torch import load_file, save_file
from transformers.trainer_utils import get_last_checkpoint

import safestage
from safestage import PublishError
from safestage.testing import hostile_mount
from safestage.transformers import CommitCallback

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_trainer_run.py"
WORLD = 2
MAX_STEPS = 8  # checkpoints at steps 2, 4, 6, 8
KILL_AT = "checkpoint-6"  # the third checkpoint, killed once this file of it has appeared:
KILL_WHEN = {"hdfs": "model.safetensors", "mountpoint": "optimizer.pt"}
# mountpoint also publishes in the background: on_save must wait for this rank's publishes.
EXTRA_ENV = {"hdfs": {}, "mountpoint": {"SAFESTAGE_BACKGROUND": "1"}}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(
    output_dir: Path, reports: Path, root: Path, logs: Path, extra: dict[str, str]
) -> list[subprocess.Popen[bytes]]:
    """Both ranks, in one new process group (the first rank's pid)."""
    port = _free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    base.update(
        SAFESTAGE_DIR=str(root),  # the start-up hook stages every save of each rank
        SAFESTAGE_TORCH_SAVE="1",  # optimizer.pt, scheduler.pt, rng_state_*.pth too
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", SAFESTAGE_LOG_LEVEL="INFO",
        **extra,
    )  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(WORLD):
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            command = [sys.executable, str(SCRIPT), str(output_dir), str(reports), str(MAX_STEPS)]
            with open(logs / f"rank-{rank}.log", "ab") as log:  # the child keeps its own descriptor
                procs.append(
                    subprocess.Popen(
                        command, env=env, stdout=log, stderr=subprocess.STDOUT,
                        process_group=procs[0].pid if procs else 0,  # one new group: rank 0's pid
                    )
                )
    except BaseException:
        _kill(procs)
        raise
    return procs


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL the ranks' process group, as a preemption would, and reap them."""
    if procs and any(p.poll() is None for p in procs):
        os.killpg(procs[0].pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=60)


def _logs(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.iterdir()))


def _reports(reports: Path) -> list[dict[str, int]]:
    return [json.loads((reports / f"rank-{rank}.json").read_text()) for rank in range(WORLD)]


def _commit_lines(log: Path) -> list[tuple[str, int, int, float]]:
    """(checkpoint name, files, bytes, seconds) of each "committed" line CommitCallback logged."""
    found = re.findall(r"/(checkpoint-\d+): committed \((\d+) files, (\d+) bytes\) in ([0-9.]+)s", log.read_text())
    return [(name, int(files), int(size), float(seconds)) for name, files, size, seconds in found]


def _global_step(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "trainer_state.json").read_text())["global_step"])


# CI: mountpoint (direct publishes, in the background: on_save must wait for them); the long
# tier (SAFESTAGE_LONG=1) hdfs too. tests/integration/test_many_ranks.py runs the Trainer's
# commits and resume on hdfs in CI.
@pytest.mark.parametrize("mode", tiered(sorted(KILL_WHEN), ci=["mountpoint"]))
def test_trainer_killed_mid_checkpoint_resumes_from_the_newest_committed(mode, kit_mounts, tmp_path):
    output_dir = fresh_dir(kit_mounts[mode], "run")
    root, logs = tmp_path / "scratch", tmp_path / "logs"
    root.mkdir()
    logs.mkdir()

    # -- run 1: killed while its third checkpoint is being written ----------------------------
    reports1 = tmp_path / "reports-1"
    reports1.mkdir()
    started = time.monotonic()
    procs = _launch(output_dir, reports1, root, logs, EXTRA_ENV[mode])
    torn = output_dir / KILL_AT
    try:
        while not (torn / KILL_WHEN[mode]).exists():
            assert all(p.poll() is None for p in procs), "a rank ended before the kill:\n" + _logs(logs)
            assert time.monotonic() - started < 120, "no third checkpoint after 120 s:\n" + _logs(logs)
            time.sleep(0.005)
    finally:
        _kill(procs)
    killed_after = time.monotonic() - started
    killed_procs = procs
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * WORLD
    assert [r["start_step"] for r in _reports(reports1)] == [0, 0]

    # What the kill left: checkpoint-6 without a commit file, checkpoints 2 and 4 committed.
    assert (torn / safestage.COMMIT_NAME).exists() is False, (
        f"{KILL_AT} was committed before the kill landed: the test did not kill mid-checkpoint"
    )
    assert not safestage.verify(torn).complete
    assert [p.name for p in sorted(output_dir.iterdir())] == ["checkpoint-2", "checkpoint-4", KILL_AT]
    for name in ("checkpoint-2", "checkpoint-4"):
        assert safestage.verify(output_dir / name, deep=True).complete, name
    latest = safestage.latest_complete(output_dir)
    assert latest == output_dir / "checkpoint-4"
    # What resume_from_checkpoint=True would have taken (transformers#35782): the torn one.
    assert get_last_checkpoint(str(output_dir)) == str(torn)
    assert _global_step(latest) == 4
    torn_files = files_under(torn)
    assert KILL_WHEN[mode] in torn_files

    # -- run 2: the same script resumes from latest_complete and finishes ---------------------
    reports2 = tmp_path / "reports-2"
    reports2.mkdir()
    resumed_started = time.monotonic()
    procs = _launch(output_dir, reports2, root, logs, EXTRA_ENV[mode])
    try:
        for p in procs:
            p.wait(timeout=150)
    finally:
        _kill(procs)
    resumed_seconds = time.monotonic() - resumed_started
    assert [p.returncode for p in procs] == [0] * WORLD, _logs(logs)
    assert _reports(reports2) == [{"start_step": 4, "end_step": MAX_STEPS}] * WORLD  # not 6, not 0

    commits = _commit_lines(logs / "rank-0.log")  # each run's rank 0 appends to one log
    assert [name for name, *_ in commits] == ["checkpoint-2", "checkpoint-4", KILL_AT, "checkpoint-8"]
    assert "never committed" not in _logs(logs)  # the resume warning did not fire

    # save_total_limit=2 rotated 2 and 4 away; 6 was rewritten whole and committed, then 8.
    assert [p.name for p in sorted(output_dir.iterdir())] == [KILL_AT, "checkpoint-8"]
    assert safestage.latest_complete(output_dir) == output_dir / "checkpoint-8"
    assert not stray_files(output_dir), f"temp files left: {stray_files(output_dir)} (torn run: {torn_files})"
    for step in (6, 8):
        checkpoint = output_dir / f"checkpoint-{step}"
        result = safestage.verify(checkpoint, deep=True)
        assert result.complete, result.problems
        assert result.extra == []
        names = sorted(entry.path for entry in result.manifest.files)
        # every file there is in the commit; the commit file is the only other one
        assert sorted(files_under(checkpoint)) == sorted([*names, safestage.COMMIT_NAME])
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth",
                "rng_state_1.pth", "trainer_state.json", "training_args.bin"} <= set(names)  # fmt: skip
        assert _global_step(checkpoint) == step
        weights = load_file(str(checkpoint / "model.safetensors"))
        assert weights["model.embed_tokens.weight"].shape == (512, 128)
        optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=False)
        assert optimizer["state"], "optimizer state loads back"
        for rank in range(WORLD):
            torch.load(checkpoint / f"rng_state_{rank}.pth", weights_only=False)
    # The staging root holds at most what the killed ranks left while publishing (a kept copy,
    # never swept: docs/checkpoints.md); nothing of the resumed run.
    killed = {str(p.pid) for p in killed_procs}
    left = sorted(os.listdir(root))
    assert all(name.split("-")[-2] in killed for name in left), (left, killed)
    print(f"\n{mode}: killed after {killed_after:.1f} s, {KILL_AT} then held {torn_files}; "
          f"resumed run {resumed_seconds:.1f} s; commits {commits}; left in the staging root: {left}")


# -- one process, in this one: a rewrite of a committed checkpoint -------------------------------


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(index, index + 16) % 128
        return {"input_ids": ids, "labels": ids.clone()}


class _CommitFileProbe(transformers.TrainerCallback):
    """After CommitCallback's on_step_end, before the Trainer writes: is the commit file there?"""

    def __init__(self) -> None:
        self.seen: dict[int, bool] = {}

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if control.should_save:
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            self.seen[state.global_step] = (checkpoint / safestage.COMMIT_NAME).exists()


def _arguments(output_dir: Path, limit: int | None, **more: Any) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=3, save_steps=1, save_total_limit=limit,
        per_device_train_batch_size=2, use_cpu=True, report_to=[], logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, **more,
    )  # fmt: skip


def _train(output_dir: Path, resume: Path | None, limit: int | None) -> tuple[CommitCallback, _CommitFileProbe]:
    from _clients import tiny_llama

    commit, probe = CommitCallback(), _CommitFileProbe()
    trainer = transformers.Trainer(
        model=tiny_llama(), args=_arguments(output_dir, limit), train_dataset=_Tokens(), callbacks=[commit, probe]
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return commit, probe


@pytest.mark.slow
def test_a_committed_checkpoint_rewritten_by_a_resumed_run_loses_its_commit_file_first(tmp_path, caplog):
    output_dir = tmp_path / "run"
    commit, probe = _train(output_dir, None, None)
    assert [path.name for path, _, _ in commit.committed] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert probe.seen == {1: False, 2: False, 3: False}
    old = {name: (output_dir / name / safestage.COMMIT_NAME).read_bytes() for name in ("checkpoint-2", "checkpoint-3")}
    # The first run's checkpoints are an hour old, as between two jobs: the Trainer's rotation
    # sorts by mtime, and with mtimes under 1 s apart it keeps the highest steps instead, which
    # can be the old checkpoint-3 (test_a_checkpoint_the_trainers_rotation_deleted_...).
    past = time.time() - 3600
    for name in ("checkpoint-1", "checkpoint-2", "checkpoint-3"):
        os.utime(output_dir / name, (past, past))

    # Resumed from an older checkpoint than the newest (a user's choice): steps 2 and 3 are
    # written again into directories that hold commit files; each goes before the Trainer writes.
    with caplog.at_level("INFO", logger="safestage"):
        commit, probe = _train(output_dir, output_dir / "checkpoint-1", 1)
    assert probe.seen == {2: False, 3: False}
    assert [path.name for path, _, _ in commit.committed] == ["checkpoint-2", "checkpoint-3"]
    assert "is being rewritten: its commit file was removed first" in caplog.text
    assert "save_total_limit=1 deletes the previous checkpoint" in caplog.text
    # save_total_limit=1: only checkpoint-3 is left, committed again, with this run's digests.
    assert sorted(os.listdir(output_dir)) == ["checkpoint-3"]
    assert (output_dir / "checkpoint-3" / safestage.COMMIT_NAME).read_bytes() != old["checkpoint-3"]
    assert safestage.verify(output_dir / "checkpoint-3", deep=True).complete
    assert safestage.latest_complete(output_dir) == output_dir / "checkpoint-3"


def test_a_checkpoint_the_trainers_rotation_deleted_before_on_save_is_skipped(tmp_path, caplog):
    """rotate_checkpoints (save_total_limit) runs before on_save and sorts by directory mtime:
    with the older checkpoints' mtimes ahead of this host's clock (a network filesystem's
    server clock), it deletes the checkpoint it has just written. Nothing to commit: a WARNING,
    and training goes on."""
    output_dir = tmp_path / "run"
    _train(output_dir, None, None)
    ahead = time.time() + 3600
    for name in ("checkpoint-1", "checkpoint-2", "checkpoint-3"):
        os.utime(output_dir / name, (ahead, ahead))
    with caplog.at_level("WARNING", logger="safestage"):
        commit, _ = _train(output_dir, output_dir / "checkpoint-1", 2)
    assert "checkpoint-2: not there any more (removed by save_total_limit?): not committed" in caplog.text
    assert "checkpoint-2" not in [path.name for path, _, _ in commit.committed]
    assert safestage.latest_complete(output_dir) == output_dir / "checkpoint-3"


def test_a_run_resumed_from_an_uncommitted_checkpoint_is_warned_about(tmp_path, caplog):
    output_dir = tmp_path / "run"
    _train(output_dir, None, None)
    os.unlink(output_dir / "checkpoint-2" / safestage.COMMIT_NAME)  # as if killed before the commit
    with caplog.at_level("WARNING", logger="safestage"):
        _train(output_dir, output_dir / "checkpoint-2", None)  # what resume_from_checkpoint=True does
    assert "resuming at step 2, but" in caplog.text and "was never committed" in caplog.text


# -- background publishes (SAFESTAGE_BACKGROUND) on a slow mount ---------------------------------


@pytest.fixture(scope="module")
def slow_hdfs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The kit's hdfs mode with writes paced to 0.5 MB/s: publishing this tiny model (112 kB)
    takes ~0.2 s, so the Trainer goes on (rotates, ends) while files of a checkpoint are
    still publishing."""
    with hostile_mount("hdfs", tmp_path_factory.mktemp("slow-hdfs") / "mnt", mbps=0.5) as mount:
        yield mount


@pytest.mark.mounts
@pytest.mark.regression(
    "issue 18 item 5: with SAFESTAGE_BACKGROUND=1 a checkpoint the rotation deleted while its files "
    "were publishing stopped the run (PublishError ENOENT from on_save) and kept a staged copy that "
    "every later activation warned about, or was committed holding only the files that landed late"
)
def test_a_checkpoint_the_rotation_deleted_while_publishing_is_a_warning_and_the_run_goes_on(
    slow_hdfs, tmp_path, caplog
):
    output_dir = fresh_dir(slow_hdfs, "run")
    root = tmp_path / "scratch"
    root.mkdir()
    with safestage.staged(root, torch_save=True):
        _train(output_dir, None, None)
    ahead = time.time() + 3600  # the rotation then deletes the checkpoint-2 it has just written
    for name in ("checkpoint-1", "checkpoint-2", "checkpoint-3"):
        os.utime(output_dir / name, (ahead, ahead))
    # background=8: every file of a save may be publishing at once
    with caplog.at_level("WARNING", logger="safestage"), safestage.staged(root, background=8, torch_save=True):
        commit, _ = _train(output_dir, output_dir / "checkpoint-1", 2)
    assert [path.name for path, _, _ in commit.committed] == ["checkpoint-3"]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "checkpoint-2" in r.getMessage()]
    assert warned and all("save_total_limit" in text for text in warned), caplog.text
    assert os.listdir(root) == []  # no kept copy, so no later activation warns about one
    # The rotation at step 3 removed what was left of checkpoint-2; the rest is complete.
    assert sorted(os.listdir(output_dir)) == ["checkpoint-1", "checkpoint-3"]
    for name in ("checkpoint-1", "checkpoint-3"):
        result = safestage.verify(output_dir / name, deep=True)
        assert result.complete, (name, result.problems)
        assert "trainer_state.json" in {entry.path for entry in result.manifest.files}
    assert safestage.latest_complete(output_dir) == output_dir / "checkpoint-3"
    assert not stray_files(output_dir)


def _publish_then_remove(checkpoint: Path, file: str, removed: Path) -> None:
    """A background save of ``checkpoint/file`` whose publish is pending (slow mount) when
    ``removed`` is deleted, as the Trainer's rotation does (here moved aside first: see below)."""
    from safetensors.torch import save_file

    from safestage._names import parse_temp_name

    target = checkpoint / file
    save_file({"w": torch.zeros(250_000)}, str(target))  # 1 MB: 2 s to publish
    # Remove it once the publish is writing its temp there (after the rename probe of `auto`).
    deadline = time.monotonic() + 30
    while not any(
        parse_temp_name(name) and name.startswith(f".{target.name}.") for name in os.listdir(target.parent)
    ):  # its own temp, not the rename probe `auto` makes first
        assert time.monotonic() < deadline, "the background publish never started writing"
        time.sleep(0.01)
    # Moved aside at once, then removed: an rmtree in place can lose a race with the publish,
    # which, finding its temp gone while the directory is still there, writes a fresh one (what
    # a concurrent `safestage clean` needs); the rmtree's rmdir then fails and the directory
    # stays, holding the file once it lands (uncommitted: retention removes it later).
    aside = removed.with_name(f"{removed.name}.removed")
    os.rename(removed, aside)
    shutil.rmtree(aside, ignore_errors=True)
    assert not removed.exists() and not aside.exists(), f"the rotation left {removed}"


@pytest.mark.mounts
@pytest.mark.regression(
    "issue 18 item 5: with SAFESTAGE_BACKGROUND=1 a checkpoint the rotation deleted while its files "
    "were publishing stopped the run (PublishError ENOENT from on_save) and kept a staged copy that "
    "every later activation warned about"
)
def test_a_publish_that_failed_because_the_rotation_deleted_its_checkpoint_is_a_warning(slow_hdfs, tmp_path, caplog):
    output_dir = fresh_dir(slow_hdfs, "run")
    root = tmp_path / "scratch"
    root.mkdir()
    checkpoint = output_dir / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")  # the Trainer's last write before it rotates
    args, state = _arguments(output_dir, 1), transformers.TrainerState(global_step=2)
    with caplog.at_level("WARNING", logger="safestage"), safestage.staged(root, background=1):
        _publish_then_remove(checkpoint, "model.safetensors", checkpoint)
        CommitCallback().on_save(args, state, transformers.TrainerControl())  # does not raise
    assert "background publish of" in caplog.text  # the publisher's ERROR: it did fail (ENOENT)
    assert "checkpoint-2: removed by save_total_limit while model.safetensors was still publishing" in caplog.text
    assert os.listdir(root) == []  # its staged copy is not kept: no later activation warns
    assert not checkpoint.exists()


@pytest.mark.mounts
@pytest.mark.regression("issue 18 item 5: only a file of a checkpoint the rotation deleted is forgiven")
def test_a_publish_that_failed_with_enoent_in_a_checkpoint_still_there_is_raised(slow_hdfs, tmp_path):
    output_dir = fresh_dir(slow_hdfs, "run")
    root = tmp_path / "scratch"
    root.mkdir()
    checkpoint = output_dir / "checkpoint-2"
    (checkpoint / "shards").mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    args, state = _arguments(output_dir, 1), transformers.TrainerState(global_step=2)
    with pytest.raises(safestage.PublishError) as raised, safestage.staged(root, background=1):
        _publish_then_remove(checkpoint, "shards/model.safetensors", checkpoint / "shards")
        CommitCallback().on_save(args, state, transformers.TrainerControl())
    assert raised.value.errno == errno.ENOENT
    assert raised.value.staged_path is not None and os.path.exists(raised.value.staged_path)  # kept, named
    assert not (checkpoint / safestage.COMMIT_NAME).exists()


class _Messages(logging.Handler):
    """What the Trainer logs (transformers' loggers do not propagate to caplog's root)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(record.getMessage())


@pytest.mark.mounts
@pytest.mark.regression(
    "issue 18 item 11: with SAFESTAGE_BACKGROUND=1 and load_best_model_at_end=True the Trainer "
    "logged a false 'Could not locate the best model': its model.safetensors was still publishing"
)
@pytest.mark.parametrize("callback", [True, False], ids=["with-CommitCallback", "without"])
def test_load_best_model_at_end_in_background_mode_finds_the_best_checkpoint_with_the_callback(
    callback, slow_hdfs, tmp_path
):
    """The best checkpoint is the last one, whose 0.8 MB model.safetensors takes ~2 s to
    publish here. CommitCallback's on_save waits for it; without the callback nothing does,
    and the Trainer looks while it is publishing (the documented limit)."""
    output_dir = fresh_dir(slow_hdfs, "run")
    root = tmp_path / "scratch"
    root.mkdir()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    evaluations = iter(range(100))  # each evaluation scores higher: the last checkpoint is the best
    args = _arguments(
        output_dir, None, eval_strategy="steps", eval_steps=1, save_only_model=True,
        load_best_model_at_end=True, metric_for_best_model="evals", greater_is_better=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=transformers.LlamaForCausalLM(config), args=args, train_dataset=_Tokens(), eval_dataset=_Tokens(),
        compute_metrics=lambda _: {"evals": next(evaluations)}, callbacks=[CommitCallback()] if callback else [],
    )  # fmt: skip
    messages = _Messages()
    trainer_log = logging.getLogger("transformers.trainer")
    trainer_log.addHandler(messages)
    level = trainer_log.level
    trainer_log.setLevel(logging.INFO)
    try:
        with safestage.staged(root, background=1):  # SAFESTAGE_BACKGROUND=1, as the start-up hook would
            trainer.train()
    finally:
        trainer_log.removeHandler(messages)
        trainer_log.setLevel(level)
    best = output_dir / "checkpoint-3"
    assert trainer.state.best_model_checkpoint == str(best)
    lost = [text for text in messages.texts if "Could not locate the best model" in text]
    if callback:
        assert lost == [], lost
        assert any(f"Loading best model from {best}" in text for text in messages.texts), messages.texts
        assert safestage.verify(best, deep=True).complete
        weights = load_file(str(best / "model.safetensors"))
        for name, tensor in trainer.model.state_dict().items():
            assert torch.equal(weights[name], tensor), name  # the best model is the one loaded
    else:
        assert lost, "the Trainer found the best model without the callback: update docs/integrations.md"


@pytest.mark.regression("0.1 hostile review 3: commit callback on save raises publish error for a hostile json")
def test_commit_callback_on_save_raises_publish_error_for_a_hostile_json(tmp_path: Path, root: Path) -> None:
    """The same through the Trainer callback's hook: on_save must raise PublishError EBADMSG
    (the documented way the run stops), not RecursionError."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from safestage.transformers import CommitCallback

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    state = TrainerState()
    state.global_step = 4
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    save_file({"w": torch.ones(8)}, str(checkpoint / "model.safetensors"))
    (checkpoint / "trainer_state.json").write_bytes(b'{"a":' * 3000 + b"1" + b"}" * 3000)
    callback = CommitCallback(root)
    with pytest.raises(PublishError) as caught:
        callback.on_save(args, state, TrainerControl())
    assert caught.value.errno == errno.EBADMSG
    assert "trainer_state.json" in str(caught.value)
    assert safestage.latest_complete(tmp_path) is None
