"""The directory commits in flight in this process, by destination: what retention (``_prune``)
must never remove (Megatron-Bridge#5184: a cleanup deleted a checkpoint whose save was still
running, because it could not see that save).

``StagedDir._commit`` is wrapped by ``registered``: its destination counts as being committed
from the moment the commit starts until it has landed or failed, on whatever thread it runs.
Other processes' commits are seen through their staging directories instead (``_prune``).
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, TypeVar

_lock = threading.Lock()
_committing: Counter[Path] = Counter()

_Method = TypeVar("_Method", bound=Callable[..., Any])


@contextmanager
def committing(dest: Path) -> Iterator[None]:
    """``dest`` (the kernel's path of a checkpoint directory) is being committed meanwhile."""
    with _lock:
        _committing[dest] += 1
    try:
        yield
    finally:
        with _lock:
            _committing[dest] -= 1
            if _committing[dest] <= 0:
                del _committing[dest]


def registered(method: _Method) -> _Method:
    """A method of an object with ``dest`` (a StagedDir) that commits ``self.dest``."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with committing(self.dest):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def committing_now() -> set[Path]:
    """The destinations whose commit is running in this process now."""
    with _lock:
        return set(_committing)


def after_fork_in_child() -> None:  # registered by _lifecycle
    global _lock
    _lock = threading.Lock()  # the parent's committing threads do not exist here
    _committing.clear()
