"""Part ``colocated`` (extra): device memory of colocated engines against ``run/validation.py``'s formula.

For 1, 2 and 4 engines at ``off_policy.max_version_gap`` 1 and 2 (GPU; CPU twin: 1 engine, gap 1, the tiny model),
rank 0's real ``Rollouts`` with the medium model (24M parameters, bf16 wire) colocated on the device, after one
push: ``colocated_used_bytes_e<N>_gap<G>`` (the device's used memory growth from before the engines started, less the
trainer's own parameters: the engines' CUDA contexts and weight copies, and rank 0's device staging) against
``colocated_formula_bytes_e<N>_gap<G>`` (``colocated_memory_problem``'s ``engines x copies x P x w + P x w`` plus its
1 GiB of CUDA context per engine); ``colocated_formula_holds`` is 1 when every measured figure stayed under its
formula. Reported, not checked (the margin is an estimate, docs/gpu.md finding 6). The CPU twin only runs the code
path (no device memory: the figures are 0).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from gpu_checks.common import perturb, report, rollouts, tiny_model_dir


def part(out: Path, device: torch.device) -> None:
    from model_assets import build_model_dir
    from torchtitan_flux.models.weight_dict import ModelShape
    from torchtitan_flux.run.validation import CUDA_CONTEXT_BYTES, hf_param_count

    gpu = device.type == "cuda"
    model_dir = build_model_dir(out / "medium-llama", flavor="medium", seed=0) if gpu else tiny_model_dir(out)
    params, wire = hf_param_count(ModelShape.from_hf_dir(model_dir)), 2  # bfloat16 wire
    holds = True
    for engines, gap in ([(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)] if gpu else [(1, 1)]):
        if gpu:
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the previous figure's model and staging leave the allocator's cache
            free0 = torch.cuda.mem_get_info(device)[0]
        r, model = rollouts(model_dir, device, num_engines=engines, timeout_s=30.0, async_mode=False,
                            max_version_gap=gap)
        try:
            r.syncer.flush(0)
            perturb(model, 1)
            r.syncer.after_optimizer_step(1)
            own = sum(p.numel() * p.element_size() for p in model.parameters())
            used = (free0 - torch.cuda.mem_get_info(device)[0] - own) if gpu else 0
        finally:
            r.close()
            del r, model
        copies = max(2, gap + 1)
        formula = engines * copies * params * wire + params * wire + CUDA_CONTEXT_BYTES * engines
        report(f"colocated_used_bytes_e{engines}_gap{gap}", used)
        report(f"colocated_formula_bytes_e{engines}_gap{gap}", formula)
        holds = holds and used <= formula
        if gpu:
            time.sleep(2.0)  # the engine processes' contexts are gone before the next figure starts
    report("colocated_formula_holds", int(holds))
