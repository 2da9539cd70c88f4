"""Activation from the environment at interpreter start (the body of the start-up hook).

Cheap and quiet: nothing heavy is imported here. Activation registers wrapt post-import
hooks, so the patch lands when the program first imports safetensors.torch (or at once if
it already has). It never raises: a bad or removed variable, a missing staging root or a
broken install writes ONE line on stderr naming the variable, its value and what to write
instead (whether or not the program configures logging: running unstaged on a hostile
mount is a lost save), logs the same as a WARNING record, and the program runs on unstaged.
Idempotent: a .pth can run twice (site.addsitedir on the same directory), and forked
children inherit the parent's activation.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping
from typing import Optional

from . import _loud
from ._api import Stage
from ._config import (
    ENV_DIR,
    ENV_LOG_LEVEL,
    ENV_SWITCH,
    env_value,
    resolve,
    switched_on,
)
from ._errors import SafestageError, StagingError

log = logging.getLogger("safestage")

_lock = threading.Lock()
_stage: Optional[Stage] = None
_started = False


def _not_staged(message: str) -> None:
    """Staging stays off in this process: one line on stderr, the same as a log record."""
    text = f"{message}; safetensors saves in this process are not staged".replace("\n", " ")
    try:
        sys.stderr.write(f"safestage: WARNING: {text}\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # no stderr (pythonw), or closed
        pass
    log.warning("%s", text, extra={_loud.PRINTED: True})


def _configure_logging(environ: Mapping[str, str]) -> None:
    """SAFESTAGE_LOG_LEVEL: the level of the "safestage" logger, and of what its last-resort
    handler writes on stderr while the program has configured no logging itself."""
    level_text = env_value(environ, ENV_LOG_LEVEL)
    if level_text is None:
        return
    numeric = level_text.isascii() and level_text.isdigit() and len(level_text) <= 9
    level = int(level_text) if numeric else logging.getLevelName(level_text.upper())
    if isinstance(level, int):
        log.setLevel(level)
        _loud.install().setLevel(min(level, logging.WARNING))
    else:
        log.warning(
            "%s=%r is not a logging level (DEBUG, INFO, WARNING, ERROR); keeping WARNING",
            ENV_LOG_LEVEL,
            level_text,
        )


def start_from_environment(environ: Optional[Mapping[str, str]] = None) -> Optional[Stage]:
    """Activate staging if the environment asks for it; return the Stage, or None."""
    global _started, _stage
    env = os.environ if environ is None else environ
    with _lock:
        if _started:
            return _stage
        _started = True
        try:
            _configure_logging(env)
            if not switched_on(env):
                return None
            _stage = Stage(resolve(environ=env))._open()
        except StagingError as exc:
            where = env_value(env, ENV_DIR)
            source = f"{ENV_DIR}={where!r}" if where else f"{ENV_SWITCH}=1 (default root)"
            _not_staged(f"{source}: {str(exc).rstrip('.')}")
            return None
        except SafestageError as exc:
            _not_staged(str(exc))
            return None
        except Exception as exc:  # broken install, unexpected platform: never break start-up
            _not_staged(f"activation from the environment failed ({exc!r})")
            return None
        log.debug("staging on from the environment: %r", _stage)
        return _stage


def after_fork_in_child() -> None:  # registered by _lifecycle
    global _lock
    _lock = threading.Lock()

