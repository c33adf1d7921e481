"""``SyncMemory``: the one accounting point for what weight sync allocates on the trainer beyond its staging copy.

Staging (one copy of the weights in the wire dtype: pinned host memory on GPU, device memory when colocated on a
GPU) is the sync path's only model-sized buffer. Everything else it allocates goes through ``hold`` / ``release``
here: a bucket's gathered or cast tensors (``Snapshot.take``: bucket i is released once bucket i+1 is held, and
both live on the snapshot's one stream, so the allocator reuses them in stream order with no host wait), the
``DeviceRing`` slots (``Pusher``: a ring of two buckets per NCCL engine, each engine's own: review 4, finding 1).
``budget`` is two of the largest bucket plus the rings (``ring``: their total, from the number of NCCL engines) plus,
with FSDP, twice the largest gather's send buffer (``snapshot._gather_bucket`` holds its cast shards, padded send buffer
and output together while the collective runs, on meshes of ``N`` >= 2 ranks: ``L x (1 + 2/N)``; a one-rank mesh is
read in place since torchtitan 0.3.0, with no gather: before that it held 3 buckets, measured on an H200, 2026-11-27): it grows with the largest tensor (a bucket never splits a tensor: ``transport.plan_buckets``)
and the number of NCCL engines, not with the number of layers. ``peak`` is what was held at once; on GPU,
``scripts/gpu_smoke.py`` compares it with the CUDA allocator's own peak. Not counted: ``full_tensor()`` of a DTensor
that is not row-sharded, before its cast, and the one-tensor device copy torch makes when a plain parameter is cast on
its way into pinned host staging (freed in stream order: at most one tensor). Main thread and push thread: every call
under ``_lock``.
"""

from __future__ import annotations

import threading

import torch

from torchtitan_flux import compat


def new_bytes(tensors: list[torch.Tensor], params: list[torch.Tensor]) -> int:
    """Bytes of the storages among ``tensors`` that are not a parameter's own (views of a parameter cost nothing)."""
    own = {(p.to_local() if compat.is_dtensor(p) else p).untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class SyncMemory:
    """Bytes held now and at most, against ``budget`` (see the module docstring)."""

    def __init__(self, largest_bucket: int, ring: int, gather: int = 0):
        """``largest_bucket``: bytes of the largest bucket (or FSDP gather output); ``ring``: every ``DeviceRing``;
        ``gather``: the largest FSDP gather's cast shards and padded send buffer (0: no FSDP)."""
        self.budget = 2 * largest_bucket + ring + gather + 4096  # + the header and allocator rounding of small tensors
        self.held = 0
        self.peak = 0
        self._lock = threading.Lock()

    def hold(self, nbytes: int) -> int:
        with self._lock:
            self.held += nbytes
            self.peak = max(self.peak, self.held)
        return nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes
