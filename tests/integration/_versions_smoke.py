"""Smoke test run by the interpreter of a side venv holding one safetensors release.

    python _versions_smoke.py HDFS_DIR CLOSE_EIO_DIR STAGE_ROOT

The directories are on kit mounts made by the parent test (this venv has no mfusepy). Prints
one JSON object with what happened; the parent asserts on it.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import traceback
from pathlib import Path

import numpy as np
import safetensors
import safetensors.numpy
import torch
from safetensors.torch import load_file, save_file, save_model

import safestage


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = self.a  # shared weights: save_model must dedupe them


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 33, generator=g),
        "h": torch.randn(17, generator=g).to(torch.bfloat16),
        "i": torch.randint(-100, 100, (5, 3), dtype=torch.int8, generator=g),
    }


def equal(path: Path, expected: dict[str, torch.Tensor]) -> bool:
    got = load_file(str(path))
    return sorted(got) == sorted(expected) and all(torch.equal(got[k], v) for k, v in expected.items())


def mode(path: Path) -> str:
    return oct(stat.S_IMODE(os.stat(path).st_mode))


def error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def main(hdfs: Path, close_eio: Path, root: Path) -> dict[str, object]:
    out: dict[str, object] = {"version": safetensors.__version__, "torch": torch.__version__}
    data = tensors()
    model = Tied()

    with safestage.staged(root) as stage:
        save_file(data, hdfs / "file.safetensors", metadata={"k": "v"})
        save_model(model, str(hdfs / "model.safetensors"))
        arrays = {"x": np.arange(12, dtype=np.float32).reshape(3, 4)}
        safetensors.numpy.save_file(arrays, str(hdfs / "numpy.safetensors"))
    loaded_model = load_file(str(hdfs / "model.safetensors"))
    out["staged"] = {
        "strategies": [r.publish for r in stage.records],
        "file_equal": equal(hdfs / "file.safetensors", data),
        "model_equal": all(torch.equal(v, model.state_dict()[k]) for k, v in loaded_model.items()),
        "numpy_equal": bool((safetensors.numpy.load_file(str(hdfs / "numpy.safetensors"))["x"] == arrays["x"]).all()),
        "modes": sorted({mode(hdfs / n) for n in os.listdir(hdfs)}),
        "listing": sorted(os.listdir(hdfs)),
        "root_left": os.listdir(root),
    }

    plain = hdfs / "plain" / "file.safetensors"
    plain.parent.mkdir()
    try:
        save_file(data, str(plain))
        out["plain_hdfs"] = {"error": None, "equal": equal(plain, data), "mode": mode(plain)}
    except Exception as e:
        out["plain_hdfs"] = {"error": error(e), "listing": sorted(os.listdir(plain.parent))}

    try:
        save_file(data, str(close_eio / "plain.safetensors"))
        out["plain_close_eio"] = {"error": None, "exists": (close_eio / "plain.safetensors").exists()}
    except Exception as e:
        out["plain_close_eio"] = {"error": error(e)}

    try:
        with safestage.staged(root):
            save_file(data, str(close_eio / "staged.safetensors"))
        out["staged_close_eio"] = {"error": None}
    except safestage.PublishError as e:
        kept = Path(e.staged_path)
        out["staged_close_eio"] = {"error": error(e), "errno": e.errno, "kept_equal": equal(kept, data)}
    return out


if __name__ == "__main__":
    try:
        result = main(*map(Path, sys.argv[1:4]))
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    print(json.dumps(result))
