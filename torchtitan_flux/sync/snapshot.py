"""``Snapshot``: the trainer's weights, copied bucket by bucket into the staging buffer a push sends (every rank).

Every rank calls ``take(version)`` at the same step boundaries (after ``agree``: one tiny broadcast on the CPU
control group, no device-to-host sync). All of it runs on the snapshot's side stream, after an event recorded
right after ``optimizer.step()`` (``compat.SideStream``), so no weight-sync kernel runs on the default stream and
the next ``optimizer.step()`` waits for it (``WeightSyncer.before_optimizer_step``). Per bucket:

  1. gather: the bucket's FSDP2 shards (``Shard(0)`` on a 1-D mesh of 2+ ranks) are cast to the wire dtype and all-gathered
     with ONE collective (``_gather_bucket``) on a process group of the snapshot's own over the mesh's ranks
     (``gather_groups``, never FSDP's communicator); other DTensors use ``full_tensor()``, except on a one-rank mesh
     (torchtitan 0.3.0's one-rank FSDP: the local tensor is whole); plain tensors as they are;
  2. the engines' wire layout (``wire_tensor``) is applied and the bucket copied into staging (the copy casts).
A bucket's temporaries are freed once the next bucket's exist: on one stream the allocator reuses them in stream
order, so the sync path holds about two buckets (``memory.SyncMemory`` counts them). Only rank 0 owns staging:
pinned host memory on GPU, device memory shared by CUDA IPC when colocated on a GPU, shared memory when colocated
on CPU (docs/gpu.md, "Memory"); its ``seqlock`` tells colocated engines when it is whole (``transport.Seqlock``).
Parameter names are cleaned of wrapper prefixes: engines load by the model's own names.
"""

from __future__ import annotations

import math
import time
from typing import Iterable

import torch
import torch.distributed as dist

from torchtitan_flux import compat
from torchtitan_flux.models.hf import clean_name
from torchtitan_flux.wire import transport
from torchtitan_flux.sync.memory import SyncMemory, new_bytes


def clean_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``named_parameters()`` under clean names, in model order."""
    out: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():
        name = clean_name(n)
        if name in out:
            raise ValueError(f"parameters {n!r} and another one both clean to {name!r}")
        out[name] = p
    return out


def tensor_specs(model: torch.nn.Module, wire_dtype: torch.dtype | None = None) -> list[transport.TensorSpec]:
    """The ordered parameter list a push carries: clean names, global shapes, wire dtype (else each one's own)."""
    return [
        transport.TensorSpec(n, tuple(p.shape), str(wire_dtype or p.dtype).removeprefix("torch."))
        for n, p in clean_parameters(model).items()
    ]


_CONTROL: dict[str, object] = {}


def control_group():
    """The multi-rank control plane (rank 0 -> others: push decisions, rollouts): a gloo group created on first
    use on every rank (``Snapshot``), never timing out (``GROUP_TIMEOUT``); None on single-process runs."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if "pg" not in _CONTROL:
        from torchtitan_flux.wire.cuda_rules import GROUP_TIMEOUT

        _CONTROL["pg"] = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
    return _CONTROL["pg"]


class Snapshot:
    """The staging buffer and how it is filled. Main thread only, except ``staging`` (read by the push thread
    while it holds the pusher's claim; never written then) and ``side.synchronize_copy`` (push thread)."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device, is_sender: bool, bucket_bytes: int,
                 wire_dtype: torch.dtype | None, wire_tensor=None, colocated: bool = False, ring_engines: int = 0):
        self.is_sender = is_sender
        self.params = clean_parameters(model)
        self.wire_dtype = wire_dtype
        self.specs = tensor_specs(model, wire_dtype)
        self.bucket_bytes = bucket_bytes
        self.plan = transport.plan_buckets(self.specs, bucket_bytes)
        self.side = compat.SideStream(device)
        self._wire = wire_tensor  # the engines' layout hook (name, tensor, wire dtype; HF q/k rows), None: identity
        on_gpu = torch.device(device).type == "cuda"
        self.staging = self.seqlock = None
        if is_sender:
            if colocated and on_gpu:  # engines on this GPU map it by CUDA IPC
                self.staging = self.plan.allocate(device)
            else:
                self.staging = self.plan.allocate("cpu", pin_memory=on_gpu)
                if colocated:  # engines on this host map it as shared memory
                    for flat in self.staging.flats:
                        flat.share_memory_()
            self.seqlock = transport.Seqlock()
        largest = max((b.numel * transport._DTYPES[b.dtype].itemsize for b in self.plan.buckets), default=0)
        gathers = [gather_bytes([self.params[s.name] for s in self.plan.specs[b.start : b.end]], wire_dtype)
                   for b in self.plan.buckets]
        # a ``DeviceRing`` (2 x the largest bucket) per engine that may take our NCCL broadcasts (finding 1); an FSDP
        # gather's cast shards and send buffer beside its output (padded: a little more than the bucket)
        self.memory = SyncMemory(max([largest] + [out for _, out in gathers]),
                                 ring=2 * largest * ring_engines if on_gpu else 0,
                                 gather=2 * max((send for send, _ in gathers), default=0))
        self.version = -1  # newest version snapshotted
        self.last_s = 0.0
        control_group()  # collective creation: every rank, here
        self.gather_groups = gather_groups(self.params.values())

    def agree(self, flag: bool) -> bool:
        """Rank 0's decision, seen by every rank (one tiny CPU broadcast on the control group; no device sync)."""
        pg = control_group()
        if pg is None:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64)
        dist.broadcast(t, src=0, group=pg)
        return bool(t.item())

    @torch.no_grad()
    def take(self, version: int) -> None:
        """Every rank: copy (gathering shards) the parameters into staging, bucket by bucket, on the side stream."""
        t0 = time.perf_counter()
        self.version = -1  # staging is not whole until this returns: nothing is pushed from it (``LinkTable.late``)
        if self.seqlock is not None:
            self.seqlock.begin_write()  # before the first write is even queued
        self.side.record_after_main()
        held = 0
        with self.side.copy_context(), torch.profiler.record_function("flux_weight_sync.snapshot"):
            for i, bucket in enumerate(self.plan.buckets):
                params = [self.params[s.name] for s in self.plan.specs[bucket.start : bucket.end]]
                srcs = _gather_bucket(params, self.wire_dtype, self.gather_groups, self.memory)
                if self.is_sender and self._wire is not None:
                    srcs = [self._wire(s.name, t, self.wire_dtype)
                            for s, t in zip(self.plan.specs[bucket.start : bucket.end], srcs)]
                now = self.memory.hold(new_bytes(srcs, params))
                self.memory.release(held)  # the previous bucket's temporaries, reused in stream order
                held = now
                if self.is_sender:
                    torch._foreach_copy_(self.staging.bucket_views(i), srcs, non_blocking=True)
                del srcs
        self.memory.release(held)
        self.version = version
        self.last_s = time.perf_counter() - t0

    def publish(self, version: int) -> None:
        """Push thread, holding the claim, after ``side.synchronize_copy()``: staging holds ``version`` whole."""
        self.seqlock.publish(version)


def _gathered(params: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """The ``Shard(0)`` DTensors of a bucket that ONE ``all_gather_into_tensor`` gathers, and their mesh's size
    (([], 0): none, or they are on several meshes)."""
    sharded = [p for p in params if compat.is_dtensor(p) and _row_sharded(p)]
    if not sharded or len({id(p.device_mesh) for p in sharded}) != 1:
        return [], 0
    return sharded, sharded[0].device_mesh.size()


def gather_groups(params: Iterable[torch.Tensor]) -> dict[int, object]:
    """The process groups the snapshot gathers on, by ``id(device_mesh)`` of each 1-D FSDP mesh of ``params``: one
    per mesh, over its ranks, built once (every rank: the ranks' meshes are agreed on the control group, and every
    rank creates every group, in the same order). Never FSDP's own communicator: NCCL runs one communicator's kernels
    in launch order, and gather k+1 is issued after the copy of bucket k to pinned staging, so on FSDP's
    communicator the next step's first FSDP all-gather queued behind rank 0's whole device-to-host snapshot copy
    (fifth review, finding 15)."""
    meshes = {id(p.device_mesh): p.device_mesh for p in params if compat.is_dtensor(p) and _row_sharded(p)}
    ranks_of = {key: tuple(mesh.mesh.flatten().tolist()) for key, mesh in meshes.items()}
    every = [set(ranks_of.values())]
    if control_group() is not None:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, set(ranks_of.values()), group=control_group())
    backend = dist.get_backend(next(iter(meshes.values())).get_group()) if meshes else None
    groups = {ranks: dist.new_group(list(ranks), backend=backend) for ranks in sorted(set().union(*every))}
    return {key: groups[ranks] for key, ranks in ranks_of.items()}


def gather_bytes(params: list[torch.Tensor], wire_dtype: torch.dtype | None) -> tuple[int, int]:
    """(padded send buffer, gathered output) bytes of a bucket's gather in ``_gather_bucket``; (0, 0) without one."""
    sharded, world = _gathered(params)
    send = sum(-(-p.shape[0] // world) * math.prod(p.shape[1:]) * (wire_dtype or p.dtype).itemsize for p in sharded)
    return send, world * send


def _gather_bucket(params: list[torch.Tensor], wire_dtype: torch.dtype | None, groups: dict[int, object],
                   memory: SyncMemory | None = None) -> list[torch.Tensor]:
    """Full tensors of ``params``: one ``all_gather_into_tensor`` for every ``Shard(0)`` DTensor of the bucket on a
    shared 1-D mesh, on that mesh's group in ``groups`` (``gather_groups``), cast to ``wire_dtype`` first (the gather
    moves wire bytes), as are other DTensors but those on a one-rank mesh (their local tensor, as a plain tensor);
    plain tensors as they are (the copy into staging casts them: into device or CPU staging with no temporary, into pinned host staging
    through one transient device copy of that tensor, docs/gpu.md, "Memory"). ``memory`` holds the gather's temporaries
    while they live: the cast shards, the padded send buffer and the output, alive together (the caller then holds the
    output again, as its own)."""
    cast = (lambda t: t if wire_dtype is None or t.dtype == wire_dtype else t.to(wire_dtype))
    sharded, world = _gathered(params)
    if not sharded:
        return [_whole(p, cast) for p in params]
    group = groups[id(sharded[0].device_mesh)]
    parts, layout = [], []
    for p in sharded:
        rows, rest = p.shape[0], tuple(p.shape[1:])
        chunk = -(-rows // world)  # torch.chunk sizes (FSDP2's sharding)
        local = cast(p.to_local().detach())
        pad = chunk - local.shape[0]
        if pad:
            local = torch.cat([local, local.new_zeros((pad, *rest))])
        parts.append(local.reshape(-1))
        layout.append((rows, rest, chunk))
    send = torch.cat(parts)
    out = send.new_empty(world * send.numel())
    held = memory.hold(new_bytes(parts, params) + send.nbytes + out.nbytes) if memory is not None else 0
    try:
        dist.all_gather_into_tensor(out, send, group=group)
    finally:
        if memory is not None:
            memory.release(held)
    per_rank = out.view(world, send.numel())
    full, off = {}, 0
    for p, (rows, rest, chunk) in zip(sharded, layout):
        n = chunk * math.prod(rest)
        pieces = per_rank[:, off : off + n].reshape(world * chunk, *rest)
        full[id(p)] = pieces[:rows]
        off += n
    return [full[id(p)] if id(p) in full else _whole(p, cast) for p in params]


def _row_sharded(p) -> bool:
    """A ``Shard(0)`` DTensor on a 1-D mesh of two or more ranks: the bucket gather's kind."""
    from torch.distributed.tensor import Shard

    return (p.device_mesh.ndim == 1 and p.device_mesh.size() > 1 and len(p.placements) == 1
            and p.placements[0] == Shard(0) and p.dim() >= 1)


def _whole(p: torch.Tensor, cast) -> torch.Tensor:
    """A parameter that is not gathered with its bucket, as a full tensor: a DTensor on a one-rank mesh is its local
    tensor (torchtitan 0.3.0 wraps a one-rank model in FSDP too: ``full_tensor()`` would copy every parameter, 0.5-0.8
    s a snapshot of SmolLM2-135M, measured, against 0.06 s for plain tensors); other DTensors ``full_tensor()``, cast to
    the wire dtype; plain tensors as they are."""
    if not compat.is_dtensor(p):
        return p.detach()
    if p.device_mesh.size() == 1:
        return p.to_local().detach()
    return cast(p.full_tensor())
