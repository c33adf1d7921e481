"""Part ``fsdp`` (e): ``Snapshot.take`` of an FSDP2 model on a one-rank NCCL mesh (CPU twin: gloo), against the ledger.

The tiny llama (as the trainer builds it) is ``fully_shard``-ed per block and at the root on a 1-D mesh of one rank,
so every parameter is a ``Shard(0)`` DTensor: as torchtitan 0.3.0 builds every one-rank trainer. A one-rank DTensor is
read in place (``snapshot._whole``: no gather, no temporary), so the ledger's peak must be 0; the bucket gather's
``all_gather_into_tensor`` on NCCL needs two ranks, which one GPU does not give (it ran here on a one-rank mesh
until torchtitan 0.3.0, 2026-11-27). bf16 wire, 64 KiB buckets: many buckets, cast by the staging copy. Keys:
``ledger_peak_bytes`` (``SyncMemory.peak``: must be 0) <= ``ledger_budget_bytes``, ``allocator_peak_growth_bytes``
(the CUDA allocator's peak growth over the snapshot: with no gather, only the staging copy's one-tensor cast
temporary) and ``allocator_within_budget`` (reported, not a check; the H200 showed 3 buckets against a budget of 2
on 2026-11-27, when this part still gathered on a one-rank group), ``fsdp_staging_equal`` (staging equals every
parameter's ``full_tensor()`` cast to bf16: must be 1), ``fsdp_buckets``. CPU twin: the same on a gloo group (the
ledger and the gather's result; no allocator, no NCCL, no stream).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gpu_checks.common import check, report, tiny_model_dir


def part(out: Path, device: torch.device) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from common import free_port
    from torchtitan_flux import compat
    from torchtitan_flux.models import families, hf_weights
    from torchtitan_flux.sync.snapshot import Snapshot, clean_parameters

    gpu = device.type == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if gpu:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    try:
        model_dir = tiny_model_dir(out)
        config = families.config_from_hf_dir(model_dir)
        model = config.build()
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        hf_weights.load_hf_weights(model, model_dir, config)
        model.to(device)
        mesh = init_device_mesh(device.type, (1,))
        for block in model.layers.values():
            compat.fully_shard(block, mesh=mesh)
        compat.fully_shard(model, mesh=mesh)
        check(all(compat.is_dtensor(p) for p in model.parameters()), "every parameter is an FSDP2 DTensor")
        snap = Snapshot(model, device=device, is_sender=True, bucket_bytes=64 * 2**10, wire_dtype=torch.bfloat16)
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        snap.take(1)  # records the ready event on the main stream itself
        snap.side.synchronize_copy()
        if gpu:
            torch.cuda.synchronize()
            growth = torch.cuda.max_memory_allocated(device) - base
        full = {n: (p.full_tensor() if compat.is_dtensor(p) else p).detach().to(torch.bfloat16).cpu()
                for n, p in clean_parameters(model).items()}
        equal = all(torch.equal(snap.staging.views[n].cpu(), t) for n, t in full.items())
        report("fsdp_buckets", len(snap.plan.buckets))
        report("ledger_peak_bytes", snap.memory.peak)
        report("ledger_budget_bytes", snap.memory.budget)
        report("fsdp_staging_equal", int(equal))
        if gpu:
            report("allocator_peak_growth_bytes", growth)
            report("allocator_within_budget", int(growth <= snap.memory.budget))
        check(snap.memory.peak == 0, "ledger_peak_bytes == 0 (a one-rank DTensor is read in place)")
        check(equal, "fsdp_staging_equal")
    finally:
        dist.destroy_process_group()
