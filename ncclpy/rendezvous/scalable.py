"""Several NCCL unique ids for one communicator (``ncclCommInitRankScalable``, NCCL 2.23).

NCCL's bootstrap root runs in the process that called ``ncclGetUniqueId``; with one id every
rank connects to that one root, which is what limits init at scale.  With ``k`` ids NCCL splits
the ranks among ``k`` roots.  :func:`exchange_unique_ids` spreads the roots over the job: id
``i`` is made by rank ``i * N // k`` (id 0 is the bootstrap's own, from rank 0), published
under ``ncclpy/uids/{name}/{gen}/{i}``; rank 0 reads the ``k - 1`` others and publishes all
``k`` in order under ``.../all``, which every other rank reads.  Store traffic, in total:
``k`` sets and ``k - 1`` gets and deletes on rank 0's side, ``N - 1`` gets and ``N - 1`` adds
(the read count; the last reader deletes the joined key) on the others': O(N + k) operations,
``128 * k * (N - 1)`` bytes read (every rank must hand all ``k`` ids to NCCL).
"""
from __future__ import annotations

from typing import Any, List

from ..errors import ArgumentError, ArgumentTypeError
from ..store.sync import delete_key

__all__ = ["exchange_unique_ids", "check_unique_ids", "root_ranks", "uids_key"]

SCALABLE_FROM = 22300


def uids_key(name: str, generation: int, part: str) -> str:
    return f"ncclpy/uids/{name}/{generation}/{part}"


def root_ranks(world_size: int, k: int) -> List[int]:
    """The rank that makes each id: ``i * N // k`` (distinct, rank 0 first)."""
    return [i * world_size // k for i in range(k)]


def check_unique_ids(k: Any, world_size: int = 0) -> int:
    """``unique_ids`` as given to :func:`ncclpy.init`: an int from 1 to the world size."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise ArgumentTypeError(f"ncclpy.init: unique_ids: expected an int >= 1, got "
                                f"{type(k).__name__} {k!r}")
    if k < 1:
        raise ArgumentError(f"ncclpy.init: unique_ids: expected an int >= 1, got {k}")
    if world_size and k > world_size:
        raise ArgumentError(f"ncclpy.init: unique_ids={k} for {world_size} ranks; NCCL takes "
                            f"at most one id per rank")
    return k


def exchange_unique_ids(bs: Any, k: int, timeout: float) -> List[bytes]:
    """The ``k`` ids of the bootstrap ``bs`` (its own uid first), the same list on every
    rank; see the module docstring.  Store failures raise RendezvousError."""
    from .bootstrap import _as_uid, _store_call, _store_get, get_unique_id
    check_unique_ids(k, bs.world_size)
    if k == 1:
        return [bs.uid]
    store, rank, n = bs.store, bs.rank, bs.world_size
    if store is None:
        raise ArgumentError("ncclpy.init: unique_ids > 1 needs the rendezvous store to share "
                            "the extra ids, and the uid came over MPI (no store); use "
                            "uid_exchange='store' or unique_ids=1")
    roots = root_ranks(n, k)
    what = f"the NCCL unique ids of communicator {bs.name!r} generation {bs.generation}"
    if rank in roots[1:]:
        key = uids_key(bs.name, bs.generation, str(roots.index(rank)))
        _store_call(store, rank, f"publish one of {what}", key, store.set, key,
                    get_unique_id())
    all_key = uids_key(bs.name, bs.generation, "all")
    if rank == 0:
        ids = [bs.uid]
        for i in range(1, k):
            key = uids_key(bs.name, bs.generation, str(i))
            raw = _store_call(store, rank, f"read id {i} of {what} (made by rank {roots[i]})",
                              key, _store_get, store, key, timeout, wait=timeout)
            ids.append(_as_uid(raw, f"unique id read under {key!r}"))
        _store_call(store, rank, f"publish {what}", all_key, store.set, all_key, b"".join(ids))
        for i in range(1, k):
            delete_key(store, uids_key(bs.name, bs.generation, str(i)))
        return ids
    raw = _store_call(store, rank, f"read {what}", all_key, _store_get, store, all_key,
                      timeout, wait=timeout)
    raw = bytes(raw)
    if len(raw) != 128 * k:
        raise ArgumentError(f"{all_key}: expected {k} ids ({128 * k} bytes), read {len(raw)}: "
                            f"do all ranks pass the same unique_ids?")
    ids = [raw[i * 128:(i + 1) * 128] for i in range(k)]
    read_key = uids_key(bs.name, bs.generation, "read")
    if int(_store_call(store, rank, f"count the readers of {what}", read_key, store.add,
                       read_key, 1)) == n - 1:
        delete_key(store, all_key)
        delete_key(store, read_key)
    return ids

