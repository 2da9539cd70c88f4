"""CommitCallback(keep=N) and CommitCallback(background=True) with the real transformers Trainer
(issue 20): retention that waits for the commit, the warning about ``save_total_limit``, the
resume from ``latest_complete`` after pruning, and commits on a safestage thread.

A tiny Llama built from a config (nothing downloaded), one process on CPU, staged with
``safestage.staged(root, torch_save=True)`` (what SAFESTAGE_DIR and SAFESTAGE_TORCH_SAVE=1 do),
saving every step into a run directory on the kit's hdfs mount.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import transformers
from _helpers import stray_files

import safestage
from safestage import _work
from safestage.checkpoint._verify import step_of
from safestage.transformers import CommitCallback

pytestmark = pytest.mark.integration

HDFS = pytest.mark.parametrize("kit_dir", ["hdfs"], indirect=True)


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(index, index + 16) % 128
        return {"input_ids": ids, "labels": ids.clone()}


class _Probe(transformers.TrainerCallback):
    """Listed after CommitCallback: the step a run starts at, and whether a commit of the
    callback was still in flight when the Trainer was about to write the next checkpoint."""

    def __init__(self, commit: CommitCallback) -> None:
        self.commit = commit
        self.start_step: Optional[int] = None
        self.in_flight_before_save: list[int] = []

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.start_step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if control.should_save:
            self.in_flight_before_save.append(_work.running_count(self.commit))


def _arguments(output_dir: Path, steps: int, limit: Optional[int] = None, **more: Any) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=steps, save_steps=1, save_total_limit=limit,
        per_device_train_batch_size=2, use_cpu=True, report_to=[], logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, **more,
    )  # fmt: skip


def _train(
    output_dir: Path, steps: int, commit: CommitCallback, *, resume: Optional[Path] = None,
    before: tuple[transformers.TrainerCallback, ...] = (), **more: Any,
) -> _Probe:  # fmt: skip
    from _clients import tiny_llama

    probe = _Probe(commit)
    trainer = transformers.Trainer(
        model=tiny_llama(), args=_arguments(output_dir, steps, **more), train_dataset=_Tokens(),
        callbacks=[*before, commit, probe],
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return probe


def _names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory), key=step_of)


def _committed_threads(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.threadName for r in caplog.records if r.name == "safestage" and ": committed (" in r.getMessage()]


@HDFS
@pytest.mark.parametrize("background", [False, True], ids=["synchronous", "background"])
def test_keep_leaves_the_newest_complete_checkpoints_and_a_resume_from_latest_complete_works(
    background, kit_dir, root, caplog
):
    output_dir = kit_dir / "run"
    with caplog.at_level("INFO", logger="safestage"), safestage.staged(root, torch_save=True):
        commit = CommitCallback(keep=2, background=background)
        probe = _train(output_dir, 4, commit)
    assert [path.name for path, _, _ in commit.committed] == [f"checkpoint-{step}" for step in (1, 2, 3, 4)]
    assert _names(output_dir) == ["checkpoint-3", "checkpoint-4"]  # exactly the 2 newest complete
    for name in ("checkpoint-3", "checkpoint-4"):
        assert safestage.verify(output_dir / name, deep=True).complete, name
    removed = [r.getMessage() for r in caplog.records if "safestage.prune: removed" in r.getMessage()]
    assert len(removed) == 2 and "checkpoint-1" in removed[0] and "checkpoint-2" in removed[1], removed
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert not stray_files(output_dir)
    # Where the commits ran: on the Trainer's thread, or on safestage's, one at a time (none in
    # flight when the Trainer is about to write the next checkpoint), the last one waited for
    # by on_train_end (train() returned with checkpoint-4 committed).
    threads = _committed_threads(caplog)
    assert threads == ["safestage-commit" if background else "MainThread"] * 4, threads
    assert probe.in_flight_before_save == [0, 0, 0, 0]
    assert _work.running_count(commit) == 0

    # A run killed while writing checkpoint-5 leaves it without a commit file (files of it
    # only): latest_complete names checkpoint-4, the resumed run starts there and prunes.
    torn = output_dir / "checkpoint-5"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes((output_dir / "checkpoint-4" / "model.safetensors").read_bytes()[:1000])
    latest = safestage.latest_complete(output_dir)
    assert latest == output_dir / "checkpoint-4"
    caplog.clear()
    with caplog.at_level("INFO", logger="safestage"), safestage.staged(root, torch_save=True):
        commit = CommitCallback(keep=2, background=background)
        probe = _train(output_dir, 6, commit, resume=latest)
    assert probe.start_step == 4
    assert [path.name for path, _, _ in commit.committed] == ["checkpoint-5", "checkpoint-6"]
    assert _names(output_dir) == ["checkpoint-5", "checkpoint-6"]
    for name in ("checkpoint-5", "checkpoint-6"):
        result = safestage.verify(output_dir / name, deep=True)
        assert result.complete and result.extra == [], (name, result.problems)
    assert safestage.latest_complete(output_dir) == output_dir / "checkpoint-6"
    assert os.listdir(root) == []


def test_save_total_limit_is_warned_about_once_pointing_to_keep(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="safestage"):
        _train(tmp_path / "run", 2, CommitCallback(), limit=2)
    warned = [r.getMessage() for r in caplog.records if r.name == "safestage" and r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "save_total_limit=2" in warned[0] and "Megatron-Bridge#5184" in warned[0]
    assert "save_total_limit=None and CommitCallback(keep=2)" in warned[0]


def test_keep_spares_the_trainers_best_checkpoint(tmp_path):
    """load_best_model_at_end loads state.best_model_checkpoint at the end, as the Trainer's
    own rotation spares it, so does keep=: the first evaluation scores best."""
    output_dir = tmp_path / "run"
    scores = iter(range(100, 0, -1))
    from _clients import tiny_llama

    args = _arguments(
        output_dir, 4, eval_strategy="steps", eval_steps=1, load_best_model_at_end=True,
        metric_for_best_model="score", greater_is_better=True,
    )  # fmt: skip
    commit = CommitCallback(keep=1)
    trainer = transformers.Trainer(
        model=tiny_llama(), args=args, train_dataset=_Tokens(), eval_dataset=_Tokens(),
        compute_metrics=lambda _: {"score": next(scores)}, callbacks=[commit],
    )  # fmt: skip
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(output_dir / "checkpoint-1")
    assert _names(output_dir) == ["checkpoint-1", "checkpoint-4"]
    assert safestage.latest_complete(output_dir) == output_dir / "checkpoint-4"


class _SpoilCheckpoint(transformers.TrainerCallback):
    """Listed before CommitCallback: writes a torn JSON file into checkpoint-``step`` after the
    Trainer wrote it, so that its commit fails its read-back (EBADMSG)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            (Path(args.output_dir) / f"checkpoint-{self.step}" / "extra.json").write_text('{"torn": ')


@HDFS
def test_a_failed_background_commit_stops_the_run_at_the_next_save_and_prunes_nothing(kit_dir, root, caplog):
    output_dir = kit_dir / "run"
    commit = CommitCallback(keep=1, background=True)
    with caplog.at_level("ERROR", logger="safestage"), pytest.raises(safestage.PublishError) as raised, safestage.staged(root, torch_save=True):
        _train(output_dir, 4, commit, before=(_SpoilCheckpoint(2),))
    assert raised.value.errno == errno.EBADMSG and "extra.json" in str(raised.value)
    assert any("raised before the Trainer saves again" in note for note in getattr(raised.value, "__notes__", []))
    assert "background commit of" in caplog.text  # reported when it failed, too
    # checkpoint-1 committed and kept (nothing is pruned for a commit that did not land),
    # checkpoint-2 never committed; the run stopped before writing checkpoint-3.
    assert _names(output_dir) == ["checkpoint-1", "checkpoint-2"]
    assert not (output_dir / "checkpoint-2" / safestage.COMMIT_NAME).exists()
    assert safestage.latest_complete(output_dir) == output_dir / "checkpoint-1"
    _work.wait()  # observed: nothing left for exit to report


@pytest.mark.parametrize("bad", [0, -1, True, "2"])
def test_a_bad_keep_is_refused_when_the_callback_is_made(bad):
    with pytest.raises(safestage.ConfigError, match="CommitCallback: keep="):
        CommitCallback(keep=bad)


class _HeldWriter:
    """safetensors' serialize_file, held until released: while it is held, a save that waited
    for its file to be written could not return."""

    def __init__(self) -> None:
        import safetensors.torch

        self.original = safetensors.torch.serialize_file
        self.held = 0
        self.release = __import__("threading").Event()
        self.threads: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import threading

        self.threads.append(threading.current_thread().name)
        self.held += 1
        try:
            assert self.release.wait(30), "the Trainer waited for a file it should not wait for"
        finally:
            self.held -= 1
        return self.original(*args, **kwargs)


class _ReleaseAtSave(transformers.TrainerCallback):
    """Listed after CommitCallback: at the first on_save, how many file writes are still held
    (the Trainer's loop got there without waiting for them); then lets them go."""

    def __init__(self, writer: _HeldWriter) -> None:
        self.writer, self.held_at_save = writer, None

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self.held_at_save is None:
            self.held_at_save = self.writer.held
        self.writer.release.set()


@HDFS
def test_background_saves_and_commits_let_the_trainer_go_on_before_its_files_are_written(
    kit_dir, root, monkeypatch
):
    """One process, SAFESTAGE_BACKGROUND with CommitCallback(background=True): the Trainer's
    loop waits only for the copies of its state; the files are written, published and committed
    on safestage's threads, and every checkpoint is complete."""
    import safetensors.torch

    writer = _HeldWriter()
    monkeypatch.setattr(safetensors.torch, "serialize_file", writer)
    output_dir = kit_dir / "run"
    # background=8: every file of a checkpoint may be in flight (with 2, the third file's save
    # waits for a slot, here held by the first file's write forever).
    with safestage.staged(root, background=8, torch_save=True):
        commit = CommitCallback(background=True)
        release = _ReleaseAtSave(writer)
        from _clients import tiny_llama

        trainer = transformers.Trainer(
            model=tiny_llama(), args=_arguments(output_dir, 2), train_dataset=_Tokens(),
            callbacks=[commit, release],
        )  # fmt: skip
        trainer.train()
    assert release.held_at_save == 1  # model.safetensors was still to be written at on_save
    assert writer.threads and all(name.startswith("safestage-") for name in writer.threads), writer.threads
    assert [path.name for path, _, _ in commit.committed] == ["checkpoint-1", "checkpoint-2"]
    for name in ("checkpoint-1", "checkpoint-2"):
        assert safestage.verify(output_dir / name, deep=True).complete, name
    assert not stray_files(output_dir)
