"""Give torch versions without ``torch.distributed.set_timeout`` the one torchtitan 0.3.0 calls.

What: installs ``torch.distributed.set_timeout(timeout, group=None)`` as a call of
``torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)`` (what torchtitan 0.2.2's
``set_pg_timeouts`` called) when torch has no ``set_timeout``.

Versions: torchtitan 0.3.0; torch 2.15.0 has ``set_timeout`` (not patched); torch 2.13.0 lacks it (checked here),
and so do the lent GPU machines' CUDA torch 2.11 builds.

Why: torchtitan 0.3.0's ``distributed.utils.set_pg_timeouts`` calls ``torch.distributed.set_timeout`` for every
group, and ``GRPOTrainer.train`` calls it before its first step (``comm.train_timeout_seconds``): on an older torch
every run would stop with ``AttributeError`` before training. Our pinned torch is 2.15; this keeps the GPU smoke
(scripts/gpu_smoke.sh) able to train on a machine whose torch cannot be replaced.

When: installed only when ``torch.distributed`` has no ``set_timeout``.
"""

import torch.distributed as dist
from torch.distributed import distributed_c10d


def _set_timeout(timeout, group=None) -> None:
    """``torch.distributed.set_timeout`` for a torch without it: the group's (None: the default group's) timeout."""
    distributed_c10d._set_pg_timeout(timeout, group)


def apply() -> bool:
    """Install the function where torch has none; returns whether it is in effect."""
    if getattr(dist, "set_timeout", None) in (None, _set_timeout):
        dist.set_timeout = _set_timeout
        return True
    return False
