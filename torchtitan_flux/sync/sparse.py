"""``SparseBase``: rank 0's copy of the last pushed version, and the patches from it to the staged one
(``weight_sync.method = "sparse"``).

At RL learning rates most weights do not change in the dtype engines serve, so a push may send, per bucket, only the
flat indices whose bit pattern changed since the version the engine holds, and their values
(``transport.changed``; wire format: ``transport``'s header). A bucket travels as a patch when the patch is at most
``sparse_max_bytes_ratio`` of its dense bytes (an element costs its index, 4 bytes, plus its value, so a bf16 patch
pays below about a third changed), else whole. The result on the engine is bit-exact: a patch is a diff of
states, not of steps, so a push coalescing several versions carries the union of their changes.

Ownership (whoever holds the pusher's claim, like staging: the push thread, or the main thread in blocking mode):
``patches`` diffs staging against the base once per version; ``advance`` makes the base equal to staging after every
push. An engine gets a patch only when it is known to hold exactly the base version (``EngineLink.holds``, set when
a push to it completed and reset by every join, failure or resync), and the engine checks that again: its receiver
patches only an untouched buffer holding that version, and none after a rejoin (``WeightReceiver._patch_base``).
On a GPU trainer the patch tensors are pinned, like staging, so their copies to the device never wait on the host
(``cuda_rules`` N1: a copy from pageable memory may block the push thread before its deadline exists).

Simplifications: ONE base (the last pushed version): an engine that missed it (lagging, rejoined, restarted) gets
a dense push, never a patch against an older version; the diff runs on the host copy (the staging buffer is host
memory wherever a wire exists: pinned on GPU), on the push thread, so async mode hides it; the base costs one more
host copy of the weights in the wire dtype (not on the device: ``memory.SyncMemory`` does not count it).
"""

from __future__ import annotations

import time

import torch

from torchtitan_flux.wire import transport

Patch = tuple[torch.Tensor, torch.Tensor]  # (flat indices, values) of one bucket


class SparseBase:
    """See the module docstring. Only the holder of the pusher's claim calls it."""

    def __init__(self, plan: transport.BucketPlan, max_bytes_ratio: float):
        self.plan = plan
        self.max_bytes_ratio = max_bytes_ratio
        self.copy = plan.allocate("cpu")
        self.version = -1  # the version ``copy`` holds; -1: none yet (every engine gets dense)
        self._patches: tuple[int, list[Patch | None]] | None = None  # (staged version, per bucket) of the last diff
        self.last_diff_s = 0.0
        self.last_changed = 0.0  # share of elements that changed in the last diff

    def patches(self, staging: transport.FlatWeights, version: int) -> list[Patch | None]:
        """Per bucket: the patch from ``self.version`` to staged ``version``, or None where it travels whole."""
        if self._patches is not None and self._patches[0] == version:
            return self._patches[1]
        t0 = time.perf_counter()
        out: list[Patch | None] = []
        n_changed = 0
        pin = staging.flats[0].is_pinned() if staging.flats else False  # a GPU trainer's host staging
        for new, old in zip(staging.flats, self.copy.flats):
            idx = transport.changed(new, old)
            k = idx.numel()
            n_changed += k
            if k * (idx.element_size() + new.element_size()) > self.max_bytes_ratio * new.numel() * new.element_size():
                out.append(None)
                continue
            idx = idx.pin_memory() if pin else idx
            vals = torch.empty(k, dtype=new.dtype, pin_memory=pin)
            torch.index_select(new, 0, idx.long(), out=vals)
            out.append((idx, vals))
        self._patches = (version, out)
        self.last_diff_s = time.perf_counter() - t0
        self.last_changed = n_changed / max(1, sum(f.numel() for f in staging.flats))
        return out

    def advance(self, staging: transport.FlatWeights, version: int) -> None:
        """After a push of staged ``version``: the base becomes it (patched buckets: only their changed elements)."""
        if self.version == version:
            return
        diff = self._patches[1] if self._patches is not None and self._patches[0] == version else None
        for i, (dst, src) in enumerate(zip(self.copy.flats, staging.flats)):
            patch = diff[i] if diff is not None else None
            if patch is None:
                dst.copy_(src)
            else:
                transport.apply_patch(dst, *patch)
        self.version = version
        self._patches = None


def payload(flats: list[torch.Tensor], patches: list[Patch | None]) -> tuple[list[int], list[torch.Tensor]]:
    """The header counts and the tensors a sparse push sends after its header (``transport``'s wire format)."""
    counts, tensors = [], []
    for flat, patch in zip(flats, patches):
        if patch is None:
            counts.append(transport.DENSE)
            tensors.append(flat)
        else:
            counts.append(patch[0].numel())
            if patch[0].numel():
                tensors += list(patch)
    return counts, tensors
