"""Run by tests/integration/test_cuda_rules.py as 2 gloo processes (N4): while rank 0 waits on its engines after a
push (``flush``; a blocking push), rank 1 must wait on the control group, not inside the next training
collective. Rank 0's wait on engines is simulated (``_wait_acks`` sleeps ``HOLD_S``, as a slow engine's acks would);
the default group's timeout (``TIMEOUT_S``) is shorter, so a rank 1 already inside ``all_reduce`` fails. Also N14:
with ``wire_dtype = "auto"`` the bucket plans of rank 0 and rank 1 are the same, and unequal plans are refused on
every rank at construction."""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_flux.config import WeightSync
from torchtitan_flux.sync.syncer import WeightSyncer, control_group

HOLD_S, TIMEOUT_S = 3.0, 1.0


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3)).to(torch.bfloat16)
    wrong = "float32" if rank == 1 else "auto"
    cfg = WeightSync(wire_dtype=wrong, master_port=0)
    try:
        WeightSyncer(cfg, model, [], device=torch.device("cpu"), is_sender=rank == 0).close()
        raise AssertionError("a rank with another wire dtype was not refused")
    except RuntimeError as e:  # refused on every rank, not only on the one that differs
        assert "ranks [1] built another bucket plan than rank 0" in str(e), e
    for mode in ("flush", "blocking"):
        cfg = WeightSync(async_weight_update=mode == "flush", timeout_seconds=HOLD_S * 2, master_port=0)
        syncer = WeightSyncer(cfg, model, [], device=torch.device("cpu"), is_sender=rank == 0)
        plans = [None, None]
        dist.all_gather_object(plans, [(s.name, s.dtype) for s in syncer.plan.specs], group=control_group())
        assert plans[0] == plans[1] and plans[0][0][1] == "bfloat16", plans
        if rank == 0:
            syncer._wait_acks = lambda version: time.sleep(HOLD_S)  # a slow engine's acks
        if mode == "flush":
            syncer.flush(1)
        else:
            syncer.after_optimizer_step(1)
        t = torch.ones(1)
        dist.all_reduce(t)  # the next training collective: fails if rank 1 got here HOLD_S before rank 0
        assert t.item() == 2
        syncer.close()
        if rank == 0:
            print(f"{mode} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # as _gather_worker.py: skip the interpreter's finalisation (gloo teardown race)
