"""A collective commit's exchanges (``_collective._gather``, ``_broadcast``) give every rank what
torch's own ``all_gather_object`` and ``broadcast_object_list`` give, and what the ranks sent,
on 3 real gloo ranks over 40 seeded rounds of uneven payloads (None, empty, one byte, up to a
megabyte, nested, unicode); after them, the works of one group are held (the last exchange's,
replaced at each), and what a broadcast leaves held is one payload, not one per rank."""

from __future__ import annotations

import datetime
import multiprocessing
import random
from pathlib import Path
from typing import Any

RANKS = 3
ROUNDS = 40


def _payload(rng: random.Random, rank: int) -> Any:
    """One rank's value for one round: the round's seed decides every rank's, so each rank can
    rebuild what the others sent."""
    kind = rng.choice(["none", "empty", "small", "large", "nested", "text"])
    if kind == "none":
        return None
    if kind == "empty":
        return b""
    if kind == "small":
        return bytes([rank])
    if kind == "large":
        return bytes(rng.getrandbits(8) for _ in range(16)) * rng.randint(1, 1 << 16)  # up to 1 MiB
    if kind == "nested":
        return {
            "rank": rank,
            "files": [
                (f"model-{i}.safetensors", i * 7, f"{i:08x}", None)
                for i in range(rng.randint(0, 300))
            ],
        }
    return "".join(rng.choice("aé漢🙂\n\x00") for _ in range(rng.randint(0, 2000)))


def _rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from safestage.checkpoint import _collective

    dist.init_process_group(
        "gloo",
        init_method=init,
        rank=rank,
        world_size=RANKS,
        timeout=datetime.timedelta(seconds=60),
    )
    group = dist.new_group(list(range(RANKS)), backend="gloo")
    key = (tuple(range(RANKS)), 60.0)
    mismatches = []
    for round_ in range(ROUNDS):
        values = [_payload(random.Random(f"{round_}-{r}"), r) for r in range(RANKS)]
        ours = _collective._gather(dist, group, key, values[rank])
        theirs: list[Any] = [None] * RANKS
        dist.all_gather_object(theirs, values[rank], group=group)
        if ours != theirs or ours != values:
            mismatches.append(round_)
        source = round_ % RANKS
        announced = _collective._broadcast(dist, group, key, values[rank], source)
        sent = [values[rank]]
        dist.broadcast_object_list(sent, src=source, group=group)
        if announced != sent[0] or announced != values[source]:
            mismatches.append(f"broadcast {round_}")
    held = len(_collective._held)
    manifest = b"m" * (1 << 20)  # the commit step's word: the coordinator's manifest, others nothing
    _collective._gather(dist, group, key, manifest if rank == 0 else "")
    gathered = _held_bytes(_collective._held[key])
    _collective._broadcast(dist, group, key, manifest if rank == 0 else "", 0)
    announced_held = _held_bytes(_collective._held[key])
    dist.destroy_process_group()
    Path(out).write_text(f"{mismatches} {held} {gathered >= RANKS << 20} {announced_held < (1 << 20) + 4096}")


def _held_bytes(held: tuple[Any, ...]) -> int:
    import torch

    return sum(item.nbytes for item in held if isinstance(item, torch.Tensor))


def test_every_rank_gets_what_all_gather_object_gives_for_any_payloads(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    init = f"file://{tmp_path / 'rendezvous'}"
    outs = [tmp_path / f"rank{rank}.txt" for rank in range(RANKS)]
    ranks = [
        context.Process(target=_rank, args=(rank, init, str(outs[rank]))) for rank in range(RANKS)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(180)
    assert [process.exitcode for process in ranks] == [0] * RANKS
    # No round differs from all_gather_object / broadcast_object_list nor from what was sent;
    # one group's works held; a gather of a 1 MiB word holds it once per rank, a broadcast once.
    assert [out.read_text() for out in outs] == ["[] 1 True True"] * RANKS
