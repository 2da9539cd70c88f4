"""Child of test_lightning.py: Fabric.save with and without StagedCheckpointIO, one case per
destination, in a process whose TMPDIR the parent chose (tempfile caches it per process) and
whose fsspec the parent chose (PYTHONPATH). Prints one JSON line: the facts per case.

argv: a JSON list of cases {"dir": destination directory, "plugin": bool, "root": staging root}.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import tempfile


def tmpdir_files() -> set[str]:
    top = tempfile.gettempdir()
    return {os.path.relpath(os.path.join(r, n), top) for r, _, names in os.walk(top) for n in names}


def describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    cause = error.__cause__ or error.__context__
    return text + (f" <- {type(cause).__name__}: {cause}" if cause is not None else "")


def main() -> None:
    import fsspec
    import lightning as L
    import torch

    from safestage.lightning import StagedCheckpointIO

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    results = []
    for case in json.loads(sys.argv[1]):
        plugins = [StagedCheckpointIO(case["root"])] if case["plugin"] else []
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=plugins)
        dest = os.path.join(case["dir"], "last.ckpt")
        before = tmpdir_files()
        out: dict[str, object] = {"dir": case["dir"], "plugin": case["plugin"]}
        try:
            fabric.save(dest, {"model": model, "optimizer": optimizer, "step": 3})
            out["error"] = None
        except BaseException as error:  # noqa: BLE001 - the fact to report
            out["error"] = describe(error)
        if plugins:
            out["records"] = [[r.destination.name, r.publish] for r in plugins[0].records]
        out["tmpdir_new"] = sorted(tmpdir_files() - before)
        out["listing"] = sorted(os.listdir(case["dir"]))
        if os.path.exists(dest):
            out["mode"] = oct(stat.S_IMODE(os.stat(dest).st_mode))
            back = torch.load(dest, weights_only=True)
            out["equal"] = back["step"] == 3 and all(torch.equal(back["model"][k], v) for k, v in expected.items())
            out["optimizer_equal"] = back["optimizer"]["state"][0]["momentum_buffer"].equal(
                optimizer.state_dict()["state"][0]["momentum_buffer"]
            )
            with open(dest, "rb") as stream:
                out["sha256"] = hashlib.sha256(stream.read()).hexdigest()
        results.append(out)
    print(json.dumps({"fsspec": fsspec.__version__, "tmpdir": tempfile.gettempdir(), "cases": results}))


if __name__ == "__main__":
    main()
