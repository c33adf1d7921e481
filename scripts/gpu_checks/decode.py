"""The embedded engine's decode step on one GPU (GPU review 5, section 4's 15-minute check): ``benchmarks/engine.py
--device cuda`` on Qwen3-0.6B's shape (random bf16 weights, ``one_gpu.build_model_dir``) at 1, 64 and 256 rows, 64
new tokens: the serial loop, the continuous batcher (eager, and with its decode steps replayed from CUDA graphs:
``rollout.decode_graphs``) and HF ``generate`` side by side, and for the batcher, eager and with graphs, its kernel
launches, GPU-busy fraction, CUDA synchronisations and peak memory per decode step.

Keys (``decode_`` + the benchmark's): ``decode_decode_ms_<side>_rows<R>``, ``decode_launches_per_decode_step_rows<R>``,
``decode_gpu_busy_fraction_rows<R>``, ``decode_cuda_syncs_per_decode_step_rows<R>``,
``decode_peak_allocated_bytes_rows<R>``, ``decode_engine_vs_hf_rows<R>``, ``decode_graph_vs_eager_rows<R>`` (the
graphs' tokens/s over eager's; the goal: >= 5 at <= 64 rows; on the CPU twin printed, not a speed), the same four
counts with ``_graphs`` for the graphs side, ``decode_host_syncs_per_decode_step`` (checked: 1.00). What only a
GPU shows: everything but the host reads; the CPU twin (the twin's small shape, rows 1 and 8, 8 tokens) runs the
same script on CPU, so a change that breaks it fails CI.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from common import run_child
from gpu_checks import one_gpu
from gpu_checks.common import check, report

ROOT = Path(__file__).resolve().parents[2]


def part(out: Path, device: torch.device, timeout: float) -> None:
    model_dir = one_gpu.build_model_dir(out / "decode-model", device)
    gpu = device.type == "cuda"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "engine.py"), "--device", device.type, "--model-dir",
           str(model_dir), "--rows", *(["1", "64", "256"] if gpu else ["1", "8"]),
           "--new-tokens", "64" if gpu else "8", "--repeats", "2" if gpu else "1", "--no-vllm"]
    proc = run_child(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    (out / "decode_bench.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    values = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line and " " not in line)
    for key, value in values.items():
        report(f"decode_{key}", value)
    check(proc.returncode == 0, f"benchmarks/engine.py exited {proc.returncode} (log: {out / 'decode_bench.log'})")
    check(values.get("host_syncs_per_decode_step") == "1.00", "host_syncs_per_decode_step == 1")
    check("graph_vs_eager_rows1" in values, "graph_vs_eager_rows1 printed (the graphs side ran)")
