"""A post-import hook of our own, not wrapt's: importing wrapt costs ~0.16 s (it pulls in
asyncio and importlib.metadata), which every process of a job with SAFESTAGE_DIR set would pay
at start-up, saving or not. ``watch`` puts a finder first on sys.meta_path: it finds a watched
module through the other finders and calls back right after the module body has executed."""

from __future__ import annotations

import sys
from typing import Any, Callable


def watch(watched: Callable[[str], bool], callback: Callable[[Any], None]) -> None:
    """From now on, ``callback(module)`` runs right after each module ``watched(name)`` is
    imported (a callback that raises breaks that import: it must not)."""
    sys.meta_path.insert(0, _PostImportFinder(watched, callback))


class _PostImportFinder:
    def __init__(self, watched: Callable[[str], bool], callback: Callable[[Any], None]) -> None:
        self._watched, self._callback = watched, callback

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not self._watched(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader, self._callback)  # type: ignore[assignment]
                return spec
        return None


class _HookedLoader:
    def __init__(self, loader: Any, callback: Callable[[Any], None]) -> None:
        self._loader, self._callback = loader, callback

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... of the real loader
        return getattr(self._loader, name)
