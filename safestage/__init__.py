"""safestage: safetensors saves that land, complete, on hostile destinations.

    import safestage
    with safestage.staged("/local/scratch") as stage:
        model.save_pretrained("/mnt/hdfs/ckpt")
    stage.records

Importing safestage imports only the standard library: torch, safetensors and wrapt are
touched when staging is first activated.
"""

from __future__ import annotations

import logging

from ._api import Stage, activate, is_active, staged, staged_file, wait
from ._errors import ConfigError, PublishError, SafestageError, StagingError
from ._stage import PublishRecord

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "PublishError",
    "PublishRecord",
    "SafestageError",
    "Stage",
    "StagingError",
    "__version__",
    "activate",
    "is_active",
    "staged",
    "staged_file",
    "wait",
]

logging.getLogger("safestage").addHandler(logging.NullHandler())
