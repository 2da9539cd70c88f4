"""Settings: explicit argument > SAFESTAGE_* environment variable > default.

Validation errors say where the bad value came from ("... from SAFESTAGE_PUBLISH"), the
habit pytest-timeout taught: a typo in a launcher script must be findable from the message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from ._errors import ConfigError
from ._paths import absolute

PathArg = Union[str, "os.PathLike[str]"]

PUBLISH_CHOICES = ("auto", "replace", "direct")

ENV_SWITCH = "SAFESTAGE"  # "1" on with the default root, "0" off even if SAFESTAGE_DIR is set
ENV_DIR = "SAFESTAGE_DIR"
ENV_PUBLISH = "SAFESTAGE_PUBLISH"
ENV_FSYNC = "SAFESTAGE_FSYNC"
ENV_LOG_LEVEL = "SAFESTAGE_LOG_LEVEL"
ENV_BACKGROUND = "SAFESTAGE_BACKGROUND"
ENV_MAX_PENDING = "SAFESTAGE_MAX_PENDING"
ENV_WHEN = "SAFESTAGE_WHEN"
ENV_TORCH_SAVE = "SAFESTAGE_TORCH_SAVE"
ENV_FOLLOW = "SAFESTAGE_FOLLOW"

WHEN_CHOICES = ("always", "auto")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@dataclass(frozen=True)
class Settings:
    """What one activation does. ``root=None`` means the per-user default root."""

    root: Optional[Path] = None
    publish: str = "auto"
    fsync: bool = True
    background: bool = False  # publish on worker threads while the caller goes on
    max_pending: int = 2  # background: files publishing at once; the caller waits beyond it
    when: str = "always"  # "auto": local-disk destinations use the original writer unstaged
    # Also stage torch.save(obj, path): a patch of a torch module global, so opt-in (README).
    torch_save: bool = False
    # Synchronous replace saves: publish while the writer is still writing (_follow). None
    # (the default, "auto"): safetensors saves known to be big; True: also saves of unknown
    # size (torch.save); False: never. Chosen from two benchmark runs (README, issue 13).
    follow: Optional[bool] = None

    def staging_root(self) -> Path:
        return self.root if self.root is not None else default_root()


def default_root() -> Path:
    """A per-user directory under the system temp dir: $TMPDIR/safestage-<uid>.

    Per user so that a world-writable /tmp cannot be used to pre-plant the directory (it is
    checked for owner and mode before use, in _stage).
    """
    import tempfile  # only when the default root is asked for: tempfile is slow to import

    return Path(tempfile.gettempdir()) / f"safestage-{os.getuid()}"


def env_value(environ: Mapping[str, str], name: str) -> Optional[str]:
    """The stripped value of ``name``, or None when unset, empty or only white space."""
    value = environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def parse_publish(value: object, source: str) -> str:
    if not isinstance(value, str) or value.strip().lower() not in PUBLISH_CHOICES:
        raise ConfigError(
            f"publish={value!r} from {source} is not one of {', '.join(PUBLISH_CHOICES)}: "
            "'auto' (replace, or direct where the destination cannot rename), "
            "'replace' (temp file + os.replace) or 'direct' (write the final name, for object stores)"
        )
    return value.strip().lower()


def parse_bool(value: object, source: str, option: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{option}={value!r} from {source} is not a boolean: use 1 or 0")


def parse_when(value: object, source: str) -> str:
    if not isinstance(value, str) or value.strip().lower() not in WHEN_CHOICES:
        raise ConfigError(
            f"when={value!r} from {source} is not one of {', '.join(WHEN_CHOICES)}: 'always' "
            "stages every save, 'auto' writes local-disk destinations directly and stages the rest"
        )
    return value.strip().lower()


def parse_count(value: object, source: str, option: str) -> int:
    if isinstance(value, str) and _is_small_ascii_number(value.strip()):
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
        raise ConfigError(f"{option}={value!r} from {source} is not a whole number from 1 to 64")
    return value


def _is_small_ascii_number(text: str) -> bool:
    # Not str.isdigit(): it accepts "²" and 5000-digit strings, which int() then rejects.
    return text.isascii() and text.isdigit() and len(text) <= 9


def parse_root(value: object, source: str) -> Path:
    if isinstance(value, bytes):
        value = os.fsdecode(value)
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(
            f"staging root {value!r} from {source} is not a path: pass a str or os.PathLike"
        )
    text = os.fspath(value)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text.strip():
        raise ConfigError(f"staging root from {source} is empty: name a local directory")
    if "\x00" in text:
        raise ConfigError(f"staging root {text!r} from {source} contains a NUL byte")
    return absolute(text)  # not abspath: "link/.." is for the kernel to resolve (issue 9)


def resolve(
    *,
    root: Any = UNSET,
    publish: Any = UNSET,
    fsync: Any = UNSET,
    background: Any = UNSET,
    max_pending: Any = UNSET,
    when: Any = UNSET,
    torch_save: Any = UNSET,
    follow: Any = UNSET,
    environ: Optional[Mapping[str, str]] = None,
) -> Settings:
    """Merge explicit arguments over the environment over the defaults.

    ``root=None`` counts as not given (the environment or the default root applies).
    """
    env = os.environ if environ is None else environ

    if root is UNSET or root is None:
        env_root = env_value(env, ENV_DIR)
        resolved_root = parse_root(env_root, ENV_DIR) if env_root is not None else None
    else:
        resolved_root = parse_root(root, "the root argument")

    if publish is UNSET:
        env_publish = env_value(env, ENV_PUBLISH)
        resolved_publish = parse_publish(env_publish, ENV_PUBLISH) if env_publish else "auto"
    else:
        resolved_publish = parse_publish(publish, "the publish argument")

    return Settings(
        root=resolved_root,
        publish=resolved_publish,
        fsync=_flag(fsync, "fsync", env, ENV_FSYNC, default=True),
        background=_flag(background, "background", env, ENV_BACKGROUND, default=False),
        max_pending=(
            parse_count(max_pending, "the max_pending argument", "max_pending")
            if max_pending is not UNSET
            else parse_count(env_value(env, ENV_MAX_PENDING) or "2", ENV_MAX_PENDING, "max_pending")
        ),
        when=(
            parse_when(when, "the when argument")
            if when is not UNSET
            else parse_when(env_value(env, ENV_WHEN) or "always", ENV_WHEN)
        ),
        torch_save=_flag(torch_save, "torch_save", env, ENV_TORCH_SAVE, default=False),
        follow=_follow(follow, env),
    )


def _follow(value: Any, env: Mapping[str, str]) -> Optional[bool]:
    """None ("auto", the default) follows the safetensors saves known to be big; True and
    False as given. SAFESTAGE_FOLLOW takes 1, 0 or auto."""
    if value is None:
        return None
    if value is UNSET:
        text = env_value(env, ENV_FOLLOW)
        if text is None or text.strip().lower() == "auto":
            return None
        if text.strip().lower() not in _TRUE | _FALSE:
            raise ConfigError(f"follow={text!r} from {ENV_FOLLOW} is not a boolean or auto: use 1, 0 or auto")
        return parse_bool(text, ENV_FOLLOW, "follow")
    if not isinstance(value, bool):
        raise ConfigError(f"follow={value!r} from the follow argument is not a bool or None (auto)")
    return value


def _flag(value: Any, option: str, env: Mapping[str, str], variable: str, *, default: bool) -> bool:
    if value is UNSET:
        text = env_value(env, variable)
        return parse_bool(text, variable, option) if text is not None else default
    if not isinstance(value, bool):
        raise ConfigError(f"{option}={value!r} from the {option} argument is not a bool")
    return value
