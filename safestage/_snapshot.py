"""Snapshots: a save's tensors copied into host buffers safestage owns (issue 26).

A background save used to return once its file was complete in the staging root: the training
loop waited for the whole local serialization (4.07 s for a 4 GiB bf16 state on an H200, 52x a
copy of it into pinned memory). It can return once its state is copied instead: the unchanged
writer then serializes from the copy on a worker. Serialization itself cannot be deferred:
safetensors 0.8 hands its writer raw pointers valid only during the call (``TensorSpec``), and
the caller's optimizer changes its tensors in place as soon as the call returns.

- ``copy_specs``: the specs of a safetensors ``serialize_file`` call (0.8's ``TensorSpec``
  pointers, or 0.4-0.7's ``{"data": bytes}``), copied; the specs of the copy point into it.
- ``copy_state``: the object of a ``torch.save``, copied the way pickle sees it (so exactly
  what ``torch.save`` would have written at the call: nested dicts, optimizer state, RNG
  states, numbers, objects), every storage once (views and shared tensors stay shared),
  storages into the buffer. The writer then pickles the copy: the same bytes.

``copy_save_file`` and ``copy_torch_save`` take a whole call's arguments as they are at the
call (the specs or the object copied, a ``metadata`` dict too), for ``_patch``'s wrappers.

CUDA tensors are copied into pinned buffers, issued non-blocking on a side stream and
synchronized once before the call returns (the physical floor: about 18 ms per GB over PCIe
Gen5); CPU tensors by ``copy_`` (a ``clone()``'s cost).

Memory is bounded. A snapshot takes one buffer, from a pool keyed by size and pinning (a
checkpoint's state has the same size every time: the second one allocates nothing), and every
buffer, in use or free, counts against the budget (``snapshot_budget`` /
``SAFESTAGE_SNAPSHOT_BUDGET``, by default a quarter of the node's memory shared by its local
ranks). A snapshot is one reservation of the budget, taken whole or not at all: its tensors'
buffer and what the pickle holds by value together (a save that reserved one part and waited
for the other waited for ever on itself). One that would pass the budget waits for older
snapshots to land (free buffers are dropped first; garbage collected once, for a snapshot
nothing holds but a cycle), holding nothing while it waits, and says
so at WARNING after ``PATIENCE`` seconds; one bigger than the whole budget is not taken: that
save serializes before it returns, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import logging
import os
import pickle
import threading
import time
import weakref
from typing import Any, Optional

from ._interrupts import deferred

log = logging.getLogger("safestage")

_ALIGN = 64  # each tensor's bytes start on a cache line of the buffer


class Held:
    """One snapshot's reservation of the budget (its buffer, if it has one), held until its
    save has landed or failed; ``release()`` (idempotent) returns the buffer to the pool. One
    that nobody released (an interrupt between the reservation and its owner) is released when
    it is garbage, its buffer dropped rather than pooled (a view of it may live on)."""

    def __init__(
        self, nbytes: int, buffer: Any, key: Optional[tuple[int, bool]], what: Optional[str] = None
    ) -> None:
        self.nbytes, self._buffer, self._key = nbytes, buffer, key
        self.what = what  # whose snapshot: named to a save that waits for the budget

    def contains(self, pointer: int, size: int) -> bool:
        buffer = self._buffer
        if buffer is None or not size:
            return False
        start: int = buffer.data_ptr()
        end: int = start + buffer.numel()
        return start <= pointer and pointer + size <= end

    def release(self) -> None:
        self._release(pool=True)

    def _release(self, *, pool: bool) -> None:
        global _in_use
        buffer, self._buffer = self._buffer, None
        with _pool:
            _in_use -= self.nbytes
            self.nbytes = 0
            if pool and buffer is not None and self._key is not None and os.getpid() == _pid:
                _free.setdefault(self._key, []).append(buffer)
            _pool.notify_all()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the module may be gone
            if self.nbytes and os.getpid() == _pid:
                self._release(pool=False)


# -- the pool and the budget --------------------------------------------------------------------

_pool = threading.Condition()
_free: dict[tuple[int, bool], list[Any]] = {}  # free buffers by (bytes, pinned)
_in_use = 0  # bytes of snapshots whose saves have not landed yet
_holders: weakref.WeakSet[Held] = weakref.WeakSet()  # their reservations, named to a waiting save
_pid = os.getpid()


def _free_bytes() -> int:
    return sum(key[0] * len(buffers) for key, buffers in _free.items())


# Seconds a snapshot waits for the budget before it says so at WARNING.
PATIENCE = 5.0


def _reserve(
    nbytes: int, budget: int, key: Optional[tuple[int, bool]] = None, what: Optional[str] = None
) -> Optional[tuple[Held, Any]]:
    """Reserve ``nbytes`` (a snapshot's whole reservation: its buffer of ``key``'s size and
    what else it holds) once in-use and free buffers with it fit ``budget``, waiting for older
    snapshots to land (free buffers are dropped first). Returns its Held and a free buffer of
    ``key`` from the pool (or None: allocate one); None when it can never fit. Nothing is
    counted while it waits: an interrupt there leaves nothing held."""
    global _in_use
    if nbytes > budget:
        return None
    if _in_use + nbytes > budget:
        # A snapshot that nothing uses any more may still count: one in the traceback of a
        # Ctrl-C that the job of its save records is garbage in a cycle, freed only by the
        # collector (which a run may have disabled: Megatron's manual GC). Collected here,
        # once, before waiting for snapshots that may be that one. With Ctrl-C held back:
        # the collection runs finalizers and gc callbacks, and a KeyboardInterrupt raised in
        # one of them is dropped by Python ("Exception ignored"), never reaching the caller.
        with deferred():
            gc.collect()
    started, said = time.monotonic(), False
    with _pool:
        while _in_use + nbytes > budget:
            waited = time.monotonic() - started
            if not said and waited >= PATIENCE:
                said = True
                holders = sorted({held.what or "a save" for held in _holders if held.nbytes})
                log.warning(
                    "safestage: the snapshot of %s has waited %.0f s for %d bytes of the snapshot "
                    "budget (%d bytes; %d in use, by the snapshots of %s, saves still being written). "
                    "It goes on once they land; a larger snapshot_budget / SAFESTAGE_SNAPSHOT_BUDGET "
                    "lets saves overlap, 0 writes each before it returns",
                    what or "a save", waited, nbytes, budget, _in_use, ", ".join(holders) or "none",
                )  # fmt: skip
            _pool.wait(None if said else max(PATIENCE - waited, 0.01))
        # Made before anything is counted: a Ctrl-C landing in between (as Held() starts)
        # would count bytes that nothing holds, for the life of the process.
        held = Held(0, None, key, what)
        reused = None
        if key is not None and _free.get(key):
            reused = _free[key].pop()
            if not _free[key]:
                del _free[key]
        while _free and _in_use + _free_bytes() + nbytes > budget:
            other = next(iter(_free))
            _free[other].pop()
            if not _free[other]:
                del _free[other]
        _in_use += nbytes
        held.nbytes, held._buffer = nbytes, reused  # no call in between: no interrupt either
        _holders.add(held)
        return held, reused


def _take_buffer(
    nbytes: int, pinned: bool, budget: int, *, extra: int = 0, what: Optional[str] = None
) -> Optional[Held]:
    """One reservation of a buffer of ``nbytes`` (pooled, or new) and ``extra`` bytes held
    beside it; None over the budget."""
    key = (nbytes, pinned) if nbytes else None
    reserved = _reserve(nbytes + extra, budget, key, what)
    if reserved is None:
        return None
    held, buffer = reserved
    if buffer is None and nbytes:
        try:
            import torch

            held._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        except BaseException:
            held.release()
            raise
    return held


def pooled_bytes() -> tuple[int, int]:
    """(bytes in use, bytes free) in the pool: what the benchmark reports as peak memory."""
    with _pool:
        return _in_use, _free_bytes()


def clear_pool() -> None:
    """Drop the free buffers (their memory goes back to the allocator)."""
    with _pool:
        _free.clear()


def after_fork_in_child() -> None:  # registered by _lifecycle
    # The parent's snapshots are its saves', not the child's; pinned memory is not inherited.
    global _pool, _in_use, _pid
    _pool = threading.Condition()
    _free.clear()
    _holders.clear()
    _in_use, _pid = 0, os.getpid()


# -- copying ------------------------------------------------------------------------------------


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // _ALIGN) * _ALIGN
    return offsets, end


def _copy(
    sources: list[Any], budget: int, *, extra: int = 0, what: Optional[str] = None
) -> Optional[tuple[list[Any], Held]]:
    """Copy the flat uint8 tensors ``sources`` into one pooled buffer, reserved in one piece
    with ``extra`` bytes the snapshot holds beside it; their copies (views of it) and its Held,
    or None when the budget cannot hold them. With CUDA sources the buffer is pinned: those are
    copied on a side stream after the work already queued on theirs, CPU ones by ``copy_``."""
    sizes = [source.numel() for source in sources]
    offsets, total = _layout(sizes)
    cuda = [source for source in sources if source.device.type == "cuda"]
    if len({source.device for source in cuda}) > 1:
        return None  # two GPUs: one side stream each; not worth it, serialized in the call
    held = _take_buffer(total, bool(cuda), budget, extra=extra, what=what)
    if held is None:
        return None
    try:
        buffer = held._buffer
        copies = [buffer[offset : offset + size] for offset, size in zip(offsets, sizes)] if total else [
            source[:0] for source in sources]  # fmt: skip
        if cuda:
            import torch

            device = cuda[0].device
            side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for copy, source in zip(copies, sources):
                    if source.device.type == "cuda":
                        copy.copy_(source, non_blocking=True)
            for copy, source in zip(copies, sources):
                if source.device.type != "cuda":
                    copy.copy_(source)
            side.synchronize()
        else:
            for copy, source in zip(copies, sources):
                copy.copy_(source)
    except BaseException:
        held.release()
        raise
    return copies, held


def _bytes_of(tensor: Any) -> Any:
    """A flat uint8 view of a contiguous tensor's bytes."""
    import torch

    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


# -- safetensors: the specs of serialize_file ---------------------------------------------------

_spec_names: Optional[dict[str, str]] = None  # TensorSpec's dtype code ("F32") -> name ("float32")


def _dtype_names(spec_type: type) -> dict[str, str]:
    global _spec_names
    if _spec_names is None:
        names = {}
        for name in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                     "uint64", "float16", "float32", "float64", "bfloat16", "float8_e4m3fn",
                     "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
                     "float4_e2m1fn_x2", "complex64"):  # fmt: skip
            try:
                names[spec_type(dtype=name, shape=[2], data_ptr=0, data_len=0).dtype] = name
            except Exception:  # a name this safetensors does not know
                continue
        _spec_names = names
    return _spec_names


def _remade(spec: Any, data_ptr: int) -> Optional[Any]:
    """``spec`` pointing at ``data_ptr``, checked to say exactly what ``spec`` says (a packed
    dtype's shape is given as stored and doubled by the constructor); None if it cannot be."""
    spec_type = type(spec)
    name = _dtype_names(spec_type).get(spec.dtype)
    if name is None:
        return None
    shape = list(spec.shape)
    for attempt in (shape, [*shape[:-1], shape[-1] // 2] if shape else None):
        if attempt is None:
            continue
        try:
            new = spec_type(dtype=name, shape=attempt, data_ptr=data_ptr, data_len=spec.data_len)
        except Exception:
            continue
        if new.dtype == spec.dtype and list(new.shape) == shape and new.data_len == spec.data_len:
            return new
    return None


def copy_save_file(
    args: tuple[Any, ...], kwargs: dict[str, Any], budget: int, *, what: Optional[str] = None
) -> Optional[tuple[tuple[Any, ...], dict[str, Any], Held]]:
    """The arguments of a ``serialize_file(tensor_dict, filename, metadata=None)`` call as
    they are at the call: its specs copied (``copy_specs``) and its ``metadata`` too (a script
    may update one dict between saves: kohya's ``ss_steps``), with the snapshot's Held; None
    when they cannot be copied: serialize now."""
    positional = len(args) > 2
    metadata = args[2] if positional else kwargs.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in [*metadata, *metadata.values()])
    ):
        return None  # safetensors refuses it: let it say so at the call
    copied = copy_specs(args[0] if args else kwargs.get("tensor_dict"), budget, what=what)
    if copied is None:
        return None
    specs, held = copied
    taken = dict(metadata) if metadata is not None else None  # str to str: a shallow copy is all of it
    if args:
        args = (specs, *args[1:])
    else:
        kwargs = {**kwargs, "tensor_dict": specs}
    if positional:
        args = (*args[:2], taken, *args[3:])
    elif "metadata" in kwargs:
        kwargs = {**kwargs, "metadata": taken}
    return args, kwargs, held


def copy_specs(
    specs: Any, budget: int, *, what: Optional[str] = None
) -> Optional[tuple[dict[str, Any], Held]]:
    """The ``tensor_dict`` of a ``serialize_file`` call, copied (see the module docstring);
    None when it cannot be (not specs this knows, over the budget): serialize it now."""
    if not isinstance(specs, dict) or not specs or budget <= 0:
        return None
    values = list(specs.values())
    if all(isinstance(spec, dict) and isinstance(spec.get("data"), bytes) for spec in values):
        # safetensors 0.4-0.7: the bytes are the spec's own (immutable): copy the dicts only;
        # they count against the budget (they are the buffer).
        reserved = _reserve(sum(len(spec["data"]) for spec in values), budget, what=what)
        if reserved is None:
            return None
        return {name: {**spec, "shape": list(spec["shape"])} for name, spec in specs.items()}, reserved[0]
    if not all(hasattr(spec, "data_ptr") and hasattr(spec, "data_len") for spec in values):
        return None
    import torch

    # The copy of this save's tensors made before safetensors flattened them (to_host): the
    # snapshot's whole reservation. Taken only by a copy that succeeds: a save refused here
    # writes from it before it returns (withdraw frees it then).
    offered: Optional[Held] = getattr(_offers, "held", None)
    # Only the specs that point elsewhere (memory of the caller's) are copied.
    copying = [name for name, spec in specs.items() if not (offered and offered.contains(spec.data_ptr, spec.data_len))]
    if offered is not None and any(specs[name].data_len for name in copying):
        # Never a second reservation beside the first: this save would wait for the budget
        # its own copy holds. Written from the copy before the call returns.
        return None
    sources = []
    for name in copying:
        spec = specs[name]
        size = int(spec.data_len)
        if size and not spec.data_ptr:
            return None
        raw = (ctypes.c_ubyte * size).from_address(spec.data_ptr) if size else bytearray()
        sources.append(torch.frombuffer(raw, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8))
    if offered is not None:
        copies: list[Any] = [source[:0] for source in sources]  # empty ones: nothing to copy
        held = offered
    else:
        copied = _copy(sources, budget, what=what)
        if copied is None:
            return None
        copies, held = copied
    result = dict(specs)
    for name, copy in zip(copying, copies):
        new = _remade(specs[name], copy.data_ptr() if copy.numel() else 0)
        if new is None:
            if offered is None:
                held.release()
            return None
        result[name] = new
    if offered is not None:
        take_offer()
        held.what = what or held.what
    return result, held


# -- CUDA tensors: into pinned memory before safetensors copies them one by one ----------------

_offers = threading.local()
# The devices whose tensors to_host copies first: CUDA (a test puts "cpu" here, to run the
# same path on a machine without a GPU).
HOST_DEVICES: tuple[str, ...] = ("cuda",)


def to_host(tensors: dict[str, Any], budget: int) -> Optional[tuple[dict[str, Any], Held]]:
    """``tensors`` (a ``save_file`` dict) with its CUDA tensors copied into one pinned buffer
    (safetensors would copy each into pageable memory: 1.5 GB/s against 55 on an H200), as
    CPU tensors over it; its CPU tensors into the same buffer (the snapshot is one reservation:
    a second one for them would wait for the budget this one holds). None when none is on CUDA,
    one cannot be copied so (safetensors then refuses it or copies it itself), or the budget
    cannot hold them all. The buffer is offered (``offer``) to the save's ``copy_specs``, which
    keeps it instead of copying."""
    import torch

    names = [name for name, tensor in tensors.items() if isinstance(tensor, torch.Tensor)]
    on = {tensors[name].device for name in names if tensors[name].device.type in HOST_DEVICES}
    if not on or len(on) != 1 or budget <= 0 or len(names) != len(tensors) or not all(
        (tensors[name].device in on or tensors[name].device.type == "cpu") and tensors[name].layout == torch.strided
        and tensors[name].is_contiguous() for name in names
    ):  # fmt: skip
        return None
    storages = [tensors[name].untyped_storage().data_ptr() for name in names if tensors[name].numel()]
    if len(set(storages)) != len(storages):
        return None  # tensors sharing memory: safetensors refuses them, and must see them so
    copied = _copy([_bytes_of(tensors[name]) for name in names], budget)
    if copied is None:
        return None
    copies, held = copied
    host = dict(tensors)
    for name, copy in zip(names, copies):
        tensor = tensors[name]
        # A storage of its own for each (safetensors refuses tensors that share one).
        own = torch.empty(0, dtype=torch.uint8).set_(_own_storage(copy))
        host[name] = own.view(tensor.dtype).view(tensor.shape) if copy.numel() else torch.empty(
            tensor.shape, dtype=tensor.dtype)  # fmt: skip
    return host, held


def offer(held: Held) -> None:
    """This thread's save in progress copied its CUDA tensors into ``held``."""
    withdraw()
    _offers.held = held


def take_offer() -> Optional[Held]:
    held = getattr(_offers, "held", None)
    _offers.held = None
    return held


def withdraw() -> None:
    """The save is over: an offer nobody took (a synchronous save) goes back to the pool."""
    held = take_offer()
    if held is not None:
        held.release()


# -- torch.save: any object, the way pickle sees it ---------------------------------------------


def copy_torch_save(
    args: tuple[Any, ...], kwargs: dict[str, Any], budget: int, *, what: Optional[str] = None
) -> Optional[tuple[tuple[Any, ...], dict[str, Any], Held]]:
    """The arguments of a ``torch.save(obj, f, pickle_module, pickle_protocol,
    _use_new_zipfile_serialization, _disable_byteorder_record)`` call as they are at the call:
    ``obj`` copied (``copy_state``; the others are a module, numbers and flags, taken as they
    are), with the snapshot's Held; None when it cannot be copied: serialize now."""
    legacy = args[4] if len(args) > 4 else kwargs.get("_use_new_zipfile_serialization", True)
    if legacy is False:
        return None  # the old format pickles by identity in ways a copy does not keep
    pickle_module = args[2] if len(args) > 2 else kwargs.get("pickle_module", pickle)
    copied = copy_state(args[0] if args else kwargs.get("obj"), budget, pickle_module, what=what)
    if copied is None:
        return None
    state, held = copied
    if args:
        return (state, *args[1:]), kwargs, held
    return args, {**kwargs, "obj": state}, held


def copy_state(
    obj: Any, budget: int, pickle_module: Any = pickle, *, what: Optional[str] = None
) -> Optional[tuple[Any, Held]]:
    """The object of a ``torch.save``, copied (see the module docstring); None when it cannot
    be: another pickle module, storages on CUDA (or any device but the CPU), a set whose copy
    would iterate in another order, over the budget (0: never; its storages and what the
    pickle holds by value together, one reservation).
    What torch.save refuses while pickling (an object that cannot be pickled, one storage viewed
    as two dtypes) raises here, at the call, as it would."""
    if pickle_module is not pickle or budget <= 0:
        return None
    import torch

    storages: list[Any] = []
    dtypes: dict[int, Any] = {}
    seen: dict[int, int] = {}

    def persistent_id(thing: Any) -> Optional[str]:
        if isinstance(thing, (set, frozenset)) and list(thing) != list(set(list(thing))):
            # A set pickles in its table's order; one that shrank keeps its big table, and
            # its copy, built afresh, iterates in another order: the save would differ.
            raise _NotKept
        if isinstance(thing, torch.storage.TypedStorage):
            untyped, dtype = thing._untyped_storage, thing.dtype
        elif isinstance(thing, torch.UntypedStorage):
            untyped, dtype = thing, torch.uint8
        else:
            return None
        key = untyped._cdata
        if key not in seen:
            seen[key], dtypes[key] = len(storages), dtype
            storages.append(untyped)
        elif untyped.data_ptr() != 0 and dtypes[key] != dtype:
            raise RuntimeError(  # torch.save's own words (torch/serialization.py)
                "Cannot save multiple tensors or storages that view the same data as different types"
            )
        return f"{seen[key]}:{dtype!s}"

    pickled = io.BytesIO()
    pickler = pickle.Pickler(pickled, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.persistent_id = persistent_id  # type: ignore[method-assign]
    try:
        pickler.dump(obj)
    except _NotKept:
        return None
    if any(storage.device.type != "cpu" for storage in storages):
        return None  # torch.save records each storage's device: a host copy would change it
    sources = [torch.empty(0, dtype=torch.uint8).set_(storage) for storage in storages]
    # What the pickle holds by value (numpy arrays, bytes, lists) counts against the budget
    # too, in the same reservation as the storages' buffer.
    copied = _copy(sources, budget, extra=pickled.tell(), what=what)
    if copied is None:
        return None
    copies, held = copied
    try:
        return _unpickle(pickled, copies), held
    except BaseException:
        held.release()
        raise


class _NotKept(Exception):
    """The object holds something whose copy would not pickle as it does: serialize now."""


def _unpickle(pickled: io.BytesIO, copies: list[Any]) -> Any:
    import torch

    loaded: dict[int, Any] = {}  # pickle asks again for each reference: one storage each

    def persistent_load(pid: str) -> Any:
        index, _, dtype = pid.partition(":")
        if int(index) not in loaded:
            loaded[int(index)] = _own_storage(copies[int(index)])
        # Typed, as torch.load hands every storage back (_rebuild_tensor_v3 of float8, uint16
        # takes the typed one; a tensor pickles its own storage again either way).
        return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
            wrap_storage=loaded[int(index)], dtype=getattr(torch, dtype.split(".")[-1]), _internal=True
        )

    pickled.seek(0)
    unpickler = pickle.Unpickler(pickled)
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    return unpickler.load()


def _own_storage(copy: Any) -> Any:
    """A storage of exactly ``copy``'s bytes over its memory in the pooled buffer (no copy):
    torch.save writes a storage whole, never the rest of the buffer."""
    import torch

    size = copy.numel()
    if not size:
        return torch.UntypedStorage(0)  # type: ignore[no-untyped-call]
    raw = (ctypes.c_ubyte * size).from_address(copy.data_ptr())
    return torch.frombuffer(raw, dtype=torch.uint8).untyped_storage()
