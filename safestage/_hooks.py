"""While staging is on, DCP's own writers and Lightning's sharded saves go through safestage.

The hook point of DCP is ``_save_state_dict``, a call-time global of ``dcp.save`` (and so of
``dcp.async_save``'s save, in its thread or its process) and of ``torch_save_to_dcp``, which
receives the writer ``dcp.save`` chose (``FileSystemWriter`` for a path) or was given: that
writer is staged and committed (``safestage.dcp.under_switch``). Lightning's sharded saves
(``save_checkpoint`` of its FSDP and ModelParallel strategies, a class attribute) commit the
whole directory, ``meta.pt`` included (``safestage.lightning.sharded_save``).

Importing this module registers both hooks with _patch and imports neither integration: each
is imported by the first save that reaches it (torch's DCP or Lightning is imported already
then, it is saving).
"""

from __future__ import annotations

from typing import Any, Callable

from . import _patch

# DCP's save of a resolved writer; format_utils (torch_save_to_dcp) bound it at import. And
# dcp.save's choice of a writer for its checkpoint_id (the saver's own binding: loads keep
# DCP's), where an object-store URL gets a staged writer: DCP has none for it without fsspec.
DCP_POINTS = (
    *((module, "_save_state_dict")
      for module in ("torch.distributed.checkpoint.state_dict_saver", "torch.distributed.checkpoint.format_utils")),
    ("torch.distributed.checkpoint.state_dict_saver", "_storage_setup"),
)  # fmt: skip
# Lightning's sharded saves: a method of each strategy class, in both packages of each.
LIGHTNING_POINTS = tuple(
    (f"{package}.strategies.{module}", f"{cls}.save_checkpoint")
    for package in ("lightning.pytorch", "pytorch_lightning", "lightning.fabric", "lightning_fabric")
    for module, cls in (("fsdp", "FSDPStrategy"), ("model_parallel", "ModelParallelStrategy"))
)


def _dcp_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """DCP's ``_save_state_dict``: its own writers, staged and committed; its
    ``_storage_setup``: a URL's writer (safestage.dcp)."""
    stage = None if _patch.bypassed() else _patch.current_stage()
    if stage is None:
        return wrapped(*args, **kwargs)
    # Imports torch's DCP: imported already, it is saving.
    from .dcp import under_switch, writer_under_switch

    if getattr(wrapped, "__name__", None) == "_storage_setup":
        return writer_under_switch(wrapped, args, kwargs, stage.settings)
    return under_switch(wrapped, args, kwargs, stage.settings)


def _lightning_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A Lightning strategy's ``save_checkpoint``: a sharded checkpoint committed whole,
    ``meta.pt`` included (safestage.lightning)."""
    stage = None if _patch.bypassed() else _patch.current_stage()
    if stage is None or instance is None:
        return wrapped(*args, **kwargs)
    from .lightning import sharded_save  # imports Lightning: imported already, it is saving

    return sharded_save(wrapped, instance, args, kwargs, stage.settings)


_patch.register("dcp", DCP_POINTS, _dcp_wrapper)
_patch.register("lightning", LIGHTNING_POINTS, _lightning_wrapper)
