#!/usr/bin/env python
"""Where one GRPO training step's time goes on CPU, for the vs-TRL workloads (the figures behind
docs/benchmarks.md "Why small sits at the edge" / "Why long cannot reach 3x").

    .venv/bin/python benchmarks/train_step.py [--workload small|long] [--reps 20]

One trainer thread (as ours runs next to its engine), torchtitan's Llama of the workload's flavor, a random batch
of the workload's shape (32 sequences; small: 30 tokens, long: 140), our GRPO loss, grad clip, foreach AdamW —
the trainer's step without the process around it. Reports, in one run:

* the first step against the steady state, with the minor page faults and kernel time of each (getrusage);
* the steady step per micro-batch size (32 / 16 / 8 rows, gradients accumulated), interleaved;
* ``torch.profiler`` self-CPU shares: matrix multiplies, attention, element-wise and the rest;
* SDPA fwd+bwd of the workload's attention shape with the flash and the math backends.

The last lines are ``key=value``: ``step_ms``, ``first_step_ms``, ``matmul_ms``, ``matmul_share``,
``elementwise_share``, ``attention_share``, ``flash_vs_math``.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))  # model_assets
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from common import ArgumentParser, count  # noqa: E402

WORKLOADS = {"small": ("tiny", 30), "long": ("small", 140)}  # flavor, tokens per sequence (prompt + completion)
B = 32
MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul"}
ELEMENTWISE = {"aten::mul", "aten::add", "aten::add_", "aten::sub", "aten::div", "aten::div_", "aten::pow",
               "aten::silu", "aten::silu_backward", "aten::rsqrt", "aten::mean", "aten::exp", "aten::neg",
               "aten::copy_", "aten::fill_", "aten::sum", "aten::mul_", "aten::clamp", "aten::where",
               "aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::gather", "aten::scatter_add_",
               "aten::minimum", "aten::maximum", "aten::lerp_", "aten::addcdiv_", "aten::addcmul_", "aten::sqrt",
               "aten::zero_", "aten::cat", "aten::view_as_real", "aten::view_as_complex"}


def build(flavor: str):
    import torch

    from torchtitan_flux.patches import apply_patches

    apply_patches()
    from model_assets import flavor_hf_config

    from torchtitan_flux.models import families

    torch.manual_seed(0)
    model = families.model_config(flavor_hf_config(flavor)).build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), foreach=True)
    return model, opt


def make_step(model, opt, L: int):
    import torch

    from torchtitan_flux.rl import loss as grpo

    g = torch.Generator().manual_seed(1)
    tok = torch.randint(3, 259, (B, L), generator=g)
    mask, beh, adv = torch.ones(B, L - 1), -5 * torch.rand(B, L - 1, generator=g), torch.randn(B, generator=g)
    n = mask.sum()

    def step(mbs: int) -> None:
        opt.zero_grad()
        for s in range(0, B, mbs):
            sl = slice(s, s + mbs)
            lp = grpo.token_logprobs(model(tok[sl])[:, :-1].float(), tok[sl, 1:], 1.0)
            loss, _ = grpo.grpo_loss(lp, beh[sl], adv[sl], mask[sl], proximal_logprobs=lp.detach(), ref_logprobs=None,
                                     sample_weights=None, clip_low=0.2, clip_high=0.28, kl_coef=0.0,
                                     kl_estimator="k3", normalization="token", tis_cap=2.0, num_tokens=n,
                                     num_sequences=B)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()

    return step


def timed(fn) -> tuple[float, int, float]:
    """(ms, minor page faults, kernel ms) of one call."""
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    return (t1 - t0) * 1e3, r1.ru_minflt - r0.ru_minflt, (r1.ru_stime - r0.ru_stime) * 1e3


def sdpa_ms(backend, shape, reps: int) -> float:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    q, k, v = (torch.randn(*shape, requires_grad=True) for _ in range(3))
    with sdpa_kernel(backend):
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        t = time.perf_counter()
        for _ in range(reps):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    return (time.perf_counter() - t) / reps * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=list(WORKLOADS), default="small")
    ap.add_argument("--reps", type=count(), default=20, help="steady steps per micro-batch size (default 20)")
    ap.add_argument("--quick", action="store_true", help="smoke run for CI (the cheapest that exercises every code path; its figures are no measurement)")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps = 2
    import torch
    from torch.nn.attention import SDPBackend
    from torch.profiler import profile

    torch.set_num_threads(1)
    flavor, L = WORKLOADS[args.workload]
    model, opt = build(flavor)
    step = make_step(model, opt, L)

    first = timed(lambda: step(B))
    warm = [timed(lambda: step(B)) for _ in range(4)]
    per_mbs: dict[int, list[float]] = {m: [] for m in (32, 16, 8)}
    for i in range(args.reps):
        for m in (per_mbs if i % 2 == 0 else list(per_mbs)[::-1]):
            per_mbs[m].append(timed(lambda: step(m))[0])
    steady = {m: statistics.median(v) for m, v in per_mbs.items()}

    with profile() as prof:
        for _ in range(5):
            step(B)
    cats = {"matmul": 0.0, "attention": 0.0, "elementwise": 0.0, "other": 0.0}
    for e in prof.key_averages():
        if not e.key.startswith("aten::"):
            continue
        cat = ("matmul" if e.key in MATMUL else "attention" if "scaled_dot_product" in e.key
               else "elementwise" if e.key in ELEMENTWISE else "other")
        cats[cat] += e.self_cpu_time_total
    total = sum(cats.values())
    share = {k: v / total for k, v in cats.items()}

    from model_assets import FLAVORS

    f = FLAVORS[flavor]
    shape = (B, f["n_heads"], L, f["dim"] // f["n_heads"])
    flash, math = sdpa_ms(SDPBackend.FLASH_ATTENTION, shape, 20), sdpa_ms(SDPBackend.MATH, shape, 20)

    print(f"training step, workload {args.workload}: flavor {flavor}, {B} x {L} tokens, 1 thread, fp32, "
          f"torch {torch.__version__}")
    print(f"{'what':<34} {'ms':>9} {'minor faults':>13} {'kernel ms':>10}")
    print(f"{'first step':<34} {first[0]:>9.1f} {first[1]:>13} {first[2]:>10.0f}")
    for i, w in enumerate(warm, 2):
        print(f"{f'step {i}':<34} {w[0]:>9.1f} {w[1]:>13} {w[2]:>10.0f}")
    for m, v in steady.items():
        print(f"{f'steady, micro-batch {m} rows':<34} {v:>9.1f}")
    print(f"profiler self-CPU per step (aten ops, 5 steps profiled): {total / 5e3:.1f} ms; "
          + ", ".join(f"{k} {v:.0%} ({cats[k] / 5e3:.1f} ms)" for k, v in share.items()))
    print(f"SDPA fwd+bwd {shape}: flash {flash:.2f} ms, math {math:.2f} ms")
    print(f"step_ms={steady[32]:.1f}")
    print(f"first_step_ms={first[0]:.1f}")
    print(f"matmul_ms={cats['matmul'] / 5e3:.1f}")
    print(f"matmul_share={share['matmul']:.2f}")
    print(f"elementwise_share={share['elementwise']:.2f}")
    print(f"attention_share={share['attention']:.2f}")
    print(f"flash_vs_math={math / flash:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
