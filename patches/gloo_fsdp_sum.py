"""Make FSDP2 reduce gradients with plain SUM on gloo.

What: wraps ``torch.distributed.fsdp.FSDPModule.set_gradient_divide_factor`` so that, when
the default process group's backend is gloo, it also calls
``self.set_force_sum_reduction_for_comms(True)``.

Versions: torchtitan 0.3.0; torch versions checked: 2.15.0.

Why: torchtitan's ``disable_fsdp_gradient_division`` (in ``torchtitan.distributed.fsdp``; 0.2.2 had it in
``torchtitan.models.llama3.infra.parallelize``), called by the FSDP setup of every model, calls
``set_gradient_divide_factor(1.0)`` on every FSDP module, after which FSDP2 reduce-scatters fp32/bf16 gradients with ``ReduceOp.PREMUL_SUM(1.0)``. gloo has no PREMUL_SUM, so the first
backward fails with ``RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo``. Forcing
sum-only reductions makes FSDP2 reduce with ``ReduceOp.SUM`` and divide by the factor
afterwards, which for a factor of 1.0 gives the same gradients.

When: always installed; acts only at call time and only when the default process group's
backend is exactly ``"gloo"`` (NCCL and mixed ``"cuda:nccl,cpu:gloo"`` groups keep
PREMUL_SUM).
"""

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

_original_set_gradient_divide_factor = FSDPModule.set_gradient_divide_factor


def _set_gradient_divide_factor(self: FSDPModule, factor: float) -> None:
    """``FSDPModule.set_gradient_divide_factor``, plus sum-only reductions on gloo."""
    _original_set_gradient_divide_factor(self, factor)
    if dist.is_initialized() and dist.get_backend() == "gloo":
        self.set_force_sum_reduction_for_comms(True)


def apply() -> bool:
    """Install the wrapper (once); returns True."""
    FSDPModule.set_gradient_divide_factor = _set_gradient_divide_factor
    return True
