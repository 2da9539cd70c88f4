"""safestage: safetensors saves that land, complete, on hostile destinations.

    import safestage
    with safestage.staged("/local/scratch") as stage:
        model.save_pretrained("/mnt/hdfs/ckpt")
    stage.records

    with safestage.staged_dir("/mnt/s3/run42/checkpoint-1000") as local:   # whole directories
        trainer_like_save(local)                                           # committed last
    safestage.latest_complete("/mnt/s3/run42")                             # resume from here
    safestage.prune("/mnt/s3/run42", keep=3)                               # retention
    safestage.fetch("s3://bucket/run42", "/local/ckpt")                    # resume from a bucket

Importing safestage imports only the standard library: torch, safetensors and wrapt are
touched when staging is first activated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _lifecycle  # noqa: F401 - the at-fork resets, registered once
from ._api import Stage, activate, is_active, staged, staged_file, wait
from ._errors import ConfigError, FetchError, PublishError, SafestageError, StagingError
from ._loud import install as _install_last_resort
from ._stage import PublishRecord

if TYPE_CHECKING:
    from ._object_store import configure_store
    from .checkpoint._fetch import fetch
    from .checkpoint._in_place import commit_in_place
    from .checkpoint._manifest import COMMIT_NAME, FileEntry, Manifest
    from .checkpoint._prune import prune
    from .checkpoint._recover import Recovered, recover
    from .checkpoint._staged_dir import StagedDir, staged_dir
    from .checkpoint._verify import Problem, VerifyResult, latest_complete, verify

# The checkpoint API is imported on first use: the start-up hook imports this package in
# every process of a job with SAFESTAGE_* set, and the directory-commit modules cost ~20 ms.
_LAZY = {
    "StagedDir": "checkpoint._staged_dir",
    "staged_dir": "checkpoint._staged_dir",
    "commit_in_place": "checkpoint._in_place",
    "fetch": "checkpoint._fetch",
    "COMMIT_NAME": "checkpoint._manifest",
    "FileEntry": "checkpoint._manifest",
    "Manifest": "checkpoint._manifest",
    "Problem": "checkpoint._verify",
    "Recovered": "checkpoint._recover",
    "recover": "checkpoint._recover",
    "VerifyResult": "checkpoint._verify",
    "prune": "checkpoint._prune",
    "latest_complete": "checkpoint._verify",
    "verify": "checkpoint._verify",
    "configure_store": "_object_store",
}

_REMOVED = {"is_complete": "safestage.verify(path).complete"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        replaced = _REMOVED.get(name)
        if replaced is not None:
            raise AttributeError(f"safestage.{name} was removed in 0.2: use {replaced}")
        raise AttributeError(f"module 'safestage' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__version__ = "0.6.1"

__all__ = [
    "COMMIT_NAME",
    "ConfigError",
    "FetchError",
    "FileEntry",
    "Manifest",
    "Problem",
    "PublishError",
    "PublishRecord",
    "Recovered",
    "SafestageError",
    "Stage",
    "StagedDir",
    "StagingError",
    "VerifyResult",
    "__version__",
    "activate",
    "commit_in_place",
    "configure_store",
    "fetch",
    "is_active",
    "latest_complete",
    "prune",
    "recover",
    "staged",
    "staged_dir",
    "staged_file",
    "verify",
    "wait",
]

# Not a NullHandler: that would silence Python's last resort, and a script that activates in
# code and configures no logging would hear no WARNING at all (_loud.LastResort).
_install_last_resort()
