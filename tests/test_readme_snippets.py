"""README's snippets run as written, against real hostile FUSE mounts of the kit.

Each snippet is the fenced block after a ``<!-- snippet: NAME -->`` marker in README.md; every
Python block of the README is one, except those the README introduces as fragments. Only the
example paths are substituted (``/mnt/hdfs/run42``: a fresh directory on a kit mount,
``/local/scratch``: a local staging root), and what the README's prose says the user's script
adds (the Trainer's model, arguments and data); each runs in a subprocess of its own, and the
test checks what a user would: the bytes load back equal, the listing holds no temp file, and
``latest_complete`` names the newest checkpoint.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mounts

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DEST = "/mnt/hdfs/run42"
SCRATCH = "/local/scratch"
_SNIPPET = re.compile(r"<!-- snippet: (\S+) -->\n```(\w+)\n(.*?)\n```", re.S)


def snippets() -> dict[str, str]:
    return {name: body for name, _lang, body in _SNIPPET.findall(README.read_text())}


def substituted(name: str, dest: Path | None = None, scratch: Path | None = None) -> str:
    body = snippets()[name]
    if dest is not None:
        assert DEST in body, f"README snippet {name!r} no longer writes to the example path {DEST}"
        body = body.replace(DEST, str(dest))
    if scratch is not None:
        assert SCRATCH in body, f"README snippet {name!r} no longer names {SCRATCH}"
        body = body.replace(SCRATCH, str(scratch))
    return body


def environment(tmp_path: Path) -> dict[str, str]:
    """A user's environment: no SAFESTAGE_* variable, this tree importable, ``python`` on
    PATH being the interpreter of the test run, a private TMPDIR (the default staging root)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    bin_dir = Path(sys.executable).parent  # a venv's bin/ has its `python`
    assert (bin_dir / "python").exists(), f"no `python` beside {sys.executable}"
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp)
    return env


def run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        args, cwd=tmp_path, env=environment(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def fresh_dir(kit_mounts: dict[str, object], mode: str, name: str) -> Path:
    directory = Path(kit_mounts[mode].path) / name  # type: ignore[attr-defined]
    directory.mkdir()
    return directory


def assert_loads_back(path: Path, expected: dict[str, object]) -> None:
    import torch
    from safetensors.torch import load_file

    back = load_file(str(path))
    assert sorted(back) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(back[key], value)  # type: ignore[arg-type]
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"


def test_readme_starts_with_the_two_setup_commands_that_ci_runs():
    text = README.read_text()
    assert text.startswith("```bash\nbash .ci/dev demo\nbash .ci/dev test\n```\n")
    assert "bash .ci/dev test" in (ROOT / ".ci" / "run").read_text()
    assert set(snippets()) == {"save_file", "train.py", "shell", "staged_dir", "lightning", "trainer"}
    assert len(text.splitlines()) < 250


def test_every_python_block_of_the_readme_is_a_snippet_or_introduced_as_a_fragment():
    """A Python block a reader may paste is run by a test of this file; the others say so."""
    text = README.read_text()
    marked = {body for _name, lang, body in _SNIPPET.findall(text) if lang == "python"}
    for match in re.finditer(r"```python\n(.*?)\n```", text, re.S):
        if match[1] in marked:
            continue
        before = text[: match.start()].rstrip().rsplit("\n\n", 1)[-1]
        assert "fragment" in before, f"README python block neither a snippet nor introduced as a fragment:\n{match[1]}"


@pytest.mark.parametrize("mode", ["hdfs", "mountpoint"])
def test_readme_with_block_around_save_file_lands_on_the_mount(kit_mounts, tmp_path, mode):
    dest = fresh_dir(kit_mounts, mode, f"readme-{os.urandom(4).hex()}")
    script = tmp_path / "snippet.py"
    script.write_text(substituted("save_file", dest))
    run([sys.executable, str(script)], tmp_path)
    assert os.listdir(dest) == ["model.safetensors"]  # no temp file of anyone's
    import torch
    from safetensors.torch import load_file

    back = load_file(str(dest / "model.safetensors"))
    assert sorted(back) == ["embed.weight", "norm.weight"]
    assert back["embed.weight"].shape == (1024, 256) and torch.equal(back["norm.weight"], torch.ones(256))
    assert oct(os.stat(dest / "model.safetensors").st_mode & 0o777) == "0o644"


def test_readme_train_py_is_staged_by_safestage_dir_alone(kit_mounts, tmp_path):
    import torch

    dest = fresh_dir(kit_mounts, "hdfs", f"readme-{os.urandom(4).hex()}")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (tmp_path / "train.py").write_text(substituted("train.py", dest))
    shell = substituted("shell", scratch=scratch)
    assert "SAFESTAGE_DIR=" in shell and "python train.py" in shell
    result = run(["bash", "-euo", "pipefail", "-c", shell], tmp_path)
    assert result.stdout.strip() == "saved"
    assert os.listdir(dest) == ["model.safetensors"]
    assert_loads_back(dest / "model.safetensors", {"weight": torch.zeros(256, 256)})
    # The plain save of the same script fails on this mount (safetensors#787): staging did it.
    plain = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=environment(tmp_path),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert plain.returncode != 0 and "os error 38" in plain.stderr


@pytest.mark.parametrize("mode", ["hdfs", "mountpoint"])
def test_readme_staged_dir_then_latest_complete_finds_the_newest(kit_mounts, tmp_path, mode):
    import torch

    import safestage

    dest = fresh_dir(kit_mounts, mode, f"readme-{os.urandom(4).hex()}")
    script = tmp_path / "snippet.py"
    script.write_text(substituted("staged_dir", dest))
    result = run([sys.executable, str(script)], tmp_path)
    assert result.stdout.strip() == str(dest / "checkpoint-2000")
    assert sorted(os.listdir(dest)) == ["checkpoint-1000", "checkpoint-2000"]
    for step in (1000, 2000):
        checkpoint = dest / f"checkpoint-{step}"
        assert sorted(os.listdir(checkpoint)) == sorted(
            ["model.safetensors", "trainer_state.json", safestage.COMMIT_NAME]
        )
        assert_loads_back(checkpoint / "model.safetensors", {"weight": torch.full((256, 256), step)})
        assert safestage.verify(checkpoint, deep=True).complete
    assert safestage.latest_complete(dest) == dest / "checkpoint-2000"
    # The staging root (TMPDIR's default) keeps nothing once the commits returned.
    leftovers = [p for p in (tmp_path / "tmp").rglob("*") if p.is_file()]
    assert leftovers == []


# -- the Trainer snippet: the prose around it says what a train.py adds -------------------------------

# What the README's prose leaves to the user's train.py: a model, its TrainingArguments
# (output_dir on the mount) and a dataset. Nothing the snippet uses (safestage, Trainer): the
# snippet must bring it, as pasted.
_TRAINER_PRELUDE = '''\
import torch
import transformers
from transformers import TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        ids = (torch.arange(index, index + 8) * 7) % 128
        return {"input_ids": ids, "labels": ids.clone()}


torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
))
args = TrainingArguments(
    output_dir=OUTPUT_DIR, max_steps=2, save_steps=1, per_device_train_batch_size=2, use_cpu=True,
    report_to=[], logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
)
data = Tokens()
'''


def trainer_snippet() -> str:
    """The README's Trainer snippet: its python block that hands the Trainer a CommitCallback."""
    blocks = [body for body in re.findall(r"```python\n(.*?)\n```", README.read_text(), re.S) if "CommitCallback(" in body]
    assert len(blocks) == 1, f"README holds {len(blocks)} python blocks with a CommitCallback, expected the one"
    body = blocks[0]
    assert body == snippets()["trainer"]
    return body.replace(DEST, "OUTPUT_DIR").replace(SCRATCH, "SCRATCH")


@pytest.mark.slow
@pytest.mark.regression("issue 24: the README's Trainer snippet raised NameError: name 'safestage' is not defined")
@pytest.mark.regression("issue 30 item 14: the README's Trainer snippet raised NameError: name 'Trainer' is not defined")
def test_readme_trainer_snippet_commits_each_checkpoint_on_the_mount(kit_mounts, tmp_path):
    import safestage

    output = fresh_dir(kit_mounts, "hdfs", f"readme-{os.urandom(4).hex()}")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    script = tmp_path / "train.py"
    script.write_text(f"OUTPUT_DIR = {str(output)!r}\nSCRATCH = {str(scratch)!r}\n" + _TRAINER_PRELUDE + trainer_snippet() + "\n")
    env = environment(tmp_path)
    env.update({"SAFESTAGE_DIR": str(scratch), "SAFESTAGE_TORCH_SAVE": "1"})  # as the README runs it

    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(os.listdir(output)) == ["checkpoint-1", "checkpoint-2"]
    assert safestage.latest_complete(output) == output / "checkpoint-2"
    for step in (1, 2):
        assert safestage.verify(output / f"checkpoint-{step}", deep=True).complete
        assert "model.safetensors" in os.listdir(output / f"checkpoint-{step}")


# -- the Lightning snippet: the Trainer it makes saves through the plugin ------------------------------

# After the snippet: a checkpoint saved through the Trainer's checkpoint IO (what ModelCheckpoint
# and trainer.save_checkpoint call), onto the mount.
_LIGHTNING_CHECK = """
import torch
assert isinstance(trainer.strategy.checkpoint_io, StagedCheckpointIO), trainer.strategy.checkpoint_io
trainer.strategy.checkpoint_io.save_checkpoint({"step": 7, "weight": torch.arange(64.0)}, OUTPUT + "/last.ckpt")
print("saved")
"""


@pytest.mark.slow
def test_readme_lightning_snippet_makes_a_trainer_that_saves_through_the_plugin(kit_mounts, tmp_path):
    import torch

    output = fresh_dir(kit_mounts, "mountpoint", f"readme-{os.urandom(4).hex()}")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    script = tmp_path / "snippet.py"
    script.write_text(f"OUTPUT = {str(output)!r}\n" + substituted("lightning", scratch=scratch) + "\n" + _LIGHTNING_CHECK)

    result = run([sys.executable, str(script)], tmp_path)

    assert result.stdout.strip().endswith("saved"), result.stdout
    assert os.listdir(output) == ["last.ckpt"]  # no temp file of anyone's
    back = torch.load(output / "last.ckpt", weights_only=True)
    assert back["step"] == 7 and torch.equal(back["weight"], torch.arange(64.0))
    assert [p for p in (tmp_path / "tmp").rglob("*") if p.is_file()] == []  # nothing in $TMPDIR
    assert [p for p in scratch.rglob("*") if p.is_file()] == []  # the staging root keeps nothing
