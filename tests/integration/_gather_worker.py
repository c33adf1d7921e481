"""Run by tests/integration/test_cuda_rules.py as 2 gloo processes: ``_gather_bucket`` on FSDP2 shards (uneven rows
too) equals ``full_tensor()`` per parameter, in ONE all_gather per bucket on the snapshot's own group over the FSDP
ranks (``gather_groups``, not FSDP's), and its temporaries go through the ledger. As ONE process: read in place."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_flux import compat
from torchtitan_flux.sync import snapshot
from torchtitan_flux.sync.memory import SyncMemory


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3), nn.Embedding(7, 2))  # 5, 3, 7 rows: uneven over 2
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    compat.fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    assert all(compat.is_dtensor(p) for p in params)
    groups = snapshot.gather_groups(params)
    calls = []
    real = dist.all_gather_into_tensor
    dist.all_gather_into_tensor = lambda *a, **k: calls.append(k["group"]) or real(*a, **k)
    memory = SyncMemory(0, ring=0)
    got = snapshot._gather_bucket(params, torch.bfloat16, groups, memory)
    dist.all_gather_into_tensor = real
    if dist.get_world_size() == 1:
        # torchtitan 0.3.0 wraps a one-rank model in FSDP2: its DTensors are read in place (the staging copy casts),
        # with no collective, no group and no temporary (full_tensor() copied every parameter: 10x the snapshot)
        assert groups == {} and calls == [] and memory.peak == 0, (groups, calls, memory.peak)
        assert all(g.data_ptr() == p.to_local().data_ptr() and torch.equal(g, p.full_tensor())
                   for g, p in zip(got, params))
        dist.destroy_process_group()
        print("one rank ok", flush=True)
        return
    want = [p.full_tensor().to(torch.bfloat16) for p in params]
    assert len(calls) == 1, calls
    # fifth review, finding 15: on a group of the snapshot's own over the FSDP ranks, not FSDP's communicator
    assert list(groups) == [id(mesh)] and calls[0] is groups[id(mesh)] and calls[0] is not mesh.get_group()
    assert dist.get_process_group_ranks(calls[0]) == list(range(dist.get_world_size()))
    # the ledger held the gather's temporaries while the collective ran: the bfloat16 shards and the padded send
    # buffer (each sum(ceil(rows / world) x columns) x 2 bytes) and the output (world x that), then let them go
    world = dist.get_world_size()
    send = sum(-(-p.shape[0] // world) * (p.shape[1] if p.dim() > 1 else 1) * 2 for p in params)
    assert (memory.peak, memory.held) == ((2 + world) * send, 0), (memory.peak, memory.held, send)
    assert snapshot.gather_bytes(params, torch.bfloat16) == (send, world * send)
    assert all(g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want))
    dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        print("gather ok", flush=True)


if __name__ == "__main__":
    main()
    # As torchtitan_flux/train.py does: skip the interpreter's finalisation, where torch's C++ gloo teardown racing
    # its own threads aborts now and then after all the work is done ("terminate called without an active
    # exception", exit -6; seen in CI).
    sys.stdout.flush()
    os._exit(0)
