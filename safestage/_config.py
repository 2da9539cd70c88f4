"""Settings: explicit argument > SAFESTAGE_* environment variable > default.

Validation errors say where the bad value came from ("... from SAFESTAGE_PUBLISH"), the
habit pytest-timeout taught: a typo in a launcher script must be findable from the message.
The names removed in 0.2 raise ConfigError naming what to write instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union, cast

from ._errors import ConfigError
from ._paths import absolute

PathArg = Union[str, "os.PathLike[str]"]
Publish = Literal["auto", "replace", "direct"]

PUBLISH_CHOICES: tuple[Publish, ...] = ("auto", "replace", "direct")

ENV_SWITCH = "SAFESTAGE"  # "1" on with the default root, "0" off even if SAFESTAGE_DIR is set
ENV_DIR = "SAFESTAGE_DIR"
ENV_PUBLISH = "SAFESTAGE_PUBLISH"
ENV_BACKGROUND = "SAFESTAGE_BACKGROUND"
ENV_SKIP_LOCAL_DISK = "SAFESTAGE_SKIP_LOCAL_DISK"
ENV_TORCH_SAVE = "SAFESTAGE_TORCH_SAVE"
ENV_LOG_LEVEL = "SAFESTAGE_LOG_LEVEL"
ENV_SNAPSHOT_BUDGET = "SAFESTAGE_SNAPSHOT_BUDGET"

BACKGROUND_ON = 2  # background=True: files publishing at once (benchmarks/README.md)
MAX_BACKGROUND = 64

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class Settings:
    """What one activation does. ``root=None`` means the per-user default root."""

    root: Optional[Path] = None
    publish: Publish = "auto"
    fsync: bool = True
    # Files publishing at once on worker threads while the caller goes on; the saving thread
    # waits beyond it. 0: every save publishes before it returns.
    background: int = 0
    skip_local_disk: bool = False  # local-disk destinations: the original writer, unstaged
    # Also stage torch.save(obj, path): a patch of a torch module global, so opt-in.
    torch_save: bool = False
    # Host memory that background saves may hold as snapshots of their state (_snapshot), in
    # bytes; 0: none (a background save serializes before it returns). None: a quarter of
    # the node's memory shared by its local ranks (default_budget).
    snapshot_budget: Optional[int] = None
    # Internal, in no public signature: synchronous replace saves publish while the writer is
    # still writing (_follow). None ("auto"): safetensors saves known to be big; True: also
    # saves of unknown size (torch.save); False: never. Tests set it with
    # dataclasses.replace(settings, follow=...) (see safestage._api.Stage).
    follow: Optional[bool] = field(default=None, repr=False)

    def staging_root(self) -> Path:
        return self.root if self.root is not None else default_root()

    def snapshot_bytes(self) -> int:
        return self.snapshot_budget if self.snapshot_budget is not None else default_budget()


def physical_memory() -> int:
    """The machine's physical memory (16 GiB if the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 16 << 30


def local_ranks() -> int:
    """How many processes of the job share this node: torchrun's LOCAL_WORLD_SIZE (1 when
    unset or not a whole number)."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(text) if text.isascii() and text.isdigit() and 0 < int(text) <= 1 << 16 else 1


def node_share(percent: int) -> int:
    """``percent`` of the node's memory, shared by its local ranks: a budget that holds per
    node (eight ranks each taking a quarter of the machine would pin twice its memory)."""
    return physical_memory() * percent // 100 // local_ranks()


def default_budget() -> int:
    """A quarter of the node's physical memory, shared by the ranks on it."""
    return node_share(25)


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


# -- names removed in 0.2 ----------------------------------------------------------------------

_FOLLOW_GONE = (
    "following is internal since safestage 0.2 (synchronous replace saves of safetensors "
    "files of 64 MiB or more are followed)"
)


def _removed_option(name: str, value: object) -> str:
    if name == "follow":
        return f"follow= is removed: drop it; {_FOLLOW_GONE}"
    if name == "max_pending":
        count = value if isinstance(value, int) and not isinstance(value, bool) else "N"
        return f"max_pending= is removed: write background={count} (at most {count} files publishing at once)"
    if value == "always":
        return "when= is removed: drop it (staging every save is the default)"
    return "when= is removed: write skip_local_disk=True (for when='auto')"


def _removed_variable(name: str, value: str) -> str:
    """What a removed variable set to ``value`` should become."""
    if name == "SAFESTAGE_FOLLOW":
        advice = f"unset it; {_FOLLOW_GONE}"
    elif name == "SAFESTAGE_MAX_PENDING" and value.lstrip("0") == "1":  # "1" is on (2) there
        advice = "one file at a time is background=1 in code; SAFESTAGE_BACKGROUND=1 is on, 2 at once"
    elif name == "SAFESTAGE_MAX_PENDING":
        count = value if _is_small_ascii_number(value) else "N"
        advice = f"write SAFESTAGE_BACKGROUND={count} instead (at most {count} files publishing at once)"
    elif name == "SAFESTAGE_WHEN" and value.lower() == "always":
        advice = "unset it (staging every save is the default)"
    elif name == "SAFESTAGE_WHEN":
        advice = "write SAFESTAGE_SKIP_LOCAL_DISK=1 instead (for auto)"
    else:  # SAFESTAGE_FSYNC
        advice = "unset it; to turn durability off, pass fsync=False in code (a decision made in code)"
    return f"{name}={value!r} is removed in safestage 0.2: {advice}"


REMOVED_OPTIONS = ("follow", "max_pending", "when")
REMOVED_VARIABLES = ("SAFESTAGE_FOLLOW", "SAFESTAGE_MAX_PENDING", "SAFESTAGE_WHEN", "SAFESTAGE_FSYNC")


def reject_removed(options: Mapping[str, object], where: str) -> None:
    """``options`` are the keyword arguments a public function did not declare: a removed
    name raises ConfigError naming its replacement; any other name the TypeError Python
    gives for an unexpected keyword argument."""
    for name, value in options.items():
        if name in REMOVED_OPTIONS:
            raise ConfigError(f"{where}: {_removed_option(name, value)}")
        raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")


def _check_removed_variables(environ: Mapping[str, str]) -> None:
    for name in REMOVED_VARIABLES:
        value = env_value(environ, name)
        if value is not None:
            raise ConfigError(_removed_variable(name, value))


# -- parsing -----------------------------------------------------------------------------------


def parse_publish(value: object, source: str) -> Publish:
    if not isinstance(value, str) or value.strip().lower() not in PUBLISH_CHOICES:
        raise ConfigError(
            f"publish={value!r} from {source} is not one of {', '.join(PUBLISH_CHOICES)}: "
            "'auto' (replace, or direct where the destination cannot rename), "
            "'replace' (temp file + os.replace) or 'direct' (write the final name, for object stores)"
        )
    return cast(Publish, value.strip().lower())


def parse_bool(value: object, source: str, option: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{option}={value!r} from {source} is not a boolean: use 1 or 0")


def parse_background(value: object, source: str) -> int:
    """Files publishing at once: True (and "1", "yes", ...) is BACKGROUND_ON, False (and "0")
    is 0, a whole number N from 1 to 64 is N. In a variable "1" means on, as for every
    boolean variable; the argument ``background=1`` means one file at a time."""
    if isinstance(value, bool):
        return BACKGROUND_ON if value else 0
    count = value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE | _FALSE:
            return BACKGROUND_ON if text in _TRUE else 0
        if _is_small_ascii_number(text):
            count = int(text)
    if isinstance(count, int) and not isinstance(count, bool) and 0 <= count <= MAX_BACKGROUND:
        return count
    if source.startswith("SAFESTAGE"):
        advice = f"use 0 (off), 1 (on: {BACKGROUND_ON} files at once) or N (at most N at once)"
    else:
        advice = f"use False, True ({BACKGROUND_ON} files at once) or N (at most N at once)"
    raise ConfigError(
        f"background={value!r} from {source} is not a boolean or a whole number from 0 to "
        f"{MAX_BACKGROUND}: {advice}"
    )


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
          "tib": 1 << 40}  # fmt: skip


def parse_budget(value: object, source: str) -> int:
    """Bytes of host memory: a whole number of bytes, or one with a unit ("8GiB", "512M";
    binary units), each per process; or a share of the node's memory ("25%"), divided among
    its local ranks (LOCAL_WORLD_SIZE); 0 is none."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if text.endswith("%") and _is_small_ascii_number(text[:-1]) and int(text[:-1]) <= 100:
            return node_share(int(text[:-1]))
        number = text.rstrip("kmgtib")
        unit = text[len(number):]
        if _is_small_ascii_number(number) and unit in _UNITS:
            return int(number) * _UNITS[unit]
    raise ConfigError(
        f"snapshot_budget={value!r} from {source} is not an amount of memory: use bytes (0 for "
        "none: background saves serialize before they return), a size such as 8GiB or 512MiB, "
        "or a share of the node's memory such as 25% (divided among its LOCAL_WORLD_SIZE ranks)"
    )


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
    root: object = None,
    publish: object = None,
    fsync: object = True,
    background: object = None,
    skip_local_disk: object = None,
    torch_save: object = None,
    snapshot_budget: object = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Settings:
    """Merge explicit arguments over the environment over the defaults. None counts as not
    given. Values are checked here too: callers without a type checker pass anything."""
    env = os.environ if environ is None else environ
    _check_removed_variables(env)

    if root is None:
        env_root = env_value(env, ENV_DIR)
        resolved_root = parse_root(env_root, ENV_DIR) if env_root is not None else None
    else:
        resolved_root = parse_root(root, "the root argument")

    if publish is None:
        env_publish = env_value(env, ENV_PUBLISH)
        resolved_publish = parse_publish(env_publish, ENV_PUBLISH) if env_publish else "auto"
    else:
        resolved_publish = parse_publish(publish, "the publish argument")

    if not isinstance(fsync, bool):
        raise ConfigError(f"fsync={fsync!r} from the fsync argument is not a bool")

    if background is None:
        env_background = env_value(env, ENV_BACKGROUND)
        resolved_background = (
            parse_background(env_background, ENV_BACKGROUND)
            if env_background is not None
            else 0
        )
    else:
        resolved_background = parse_background(background, "the background argument")

    if snapshot_budget is None:
        env_budget = env_value(env, ENV_SNAPSHOT_BUDGET)
        budget = parse_budget(env_budget, ENV_SNAPSHOT_BUDGET) if env_budget is not None else None
    else:
        budget = parse_budget(snapshot_budget, "the snapshot_budget argument")

    return Settings(
        root=resolved_root,
        publish=resolved_publish,
        fsync=fsync,
        background=resolved_background,
        skip_local_disk=_flag(skip_local_disk, "skip_local_disk", env, ENV_SKIP_LOCAL_DISK),
        torch_save=_flag(torch_save, "torch_save", env, ENV_TORCH_SAVE),
        snapshot_budget=budget,
    )


def _flag(value: object, option: str, env: Mapping[str, str], variable: str) -> bool:
    if value is None:
        text = env_value(env, variable)
        return parse_bool(text, variable, option) if text is not None else False
    if not isinstance(value, bool):
        raise ConfigError(f"{option}={value!r} from the {option} argument is not a bool")
    return value


def switched_on(environ: Mapping[str, str]) -> bool:
    """SAFESTAGE=0 wins; otherwise SAFESTAGE=1 or a non-blank SAFESTAGE_DIR turns staging on.

    Raises ConfigError for a SAFESTAGE value that is not a boolean.
    """
    switch = env_value(environ, ENV_SWITCH)
    if switch is not None:
        return parse_bool(switch, ENV_SWITCH, ENV_SWITCH)
    return env_value(environ, ENV_DIR) is not None
