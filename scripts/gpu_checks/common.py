"""What every smoke part shares: ``key=value`` reporting, checks, rank 0's real ``Rollouts`` and stand-in steps."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS: dict[str, object] = {}
FAILED: list[str] = []


def report(key: str, value) -> None:
    RESULTS[key] = value
    print(f"{key}={value}", flush=True)


def check(ok: bool, what: str) -> None:
    if not ok:
        FAILED.append(what)
        print(f"CHECK FAILED: {what}", flush=True)


def rollouts(model_dir: Path, device: torch.device, *, num_engines: int, timeout_s: float, async_mode: bool,
             colocated: bool = True, engine_devices: tuple[str, ...] = (), method: str = "dense",
             bucket_size_mb: float = 1.0, wire_dtype: str = "bfloat16", max_version_gap: int = 1):
    """Rank 0's real rollout side on ``device`` (engines colocated, or on ``engine_devices``), as the trainer builds
    it; returns (rollouts, the trainer's model)."""
    from torchtitan_flux.config import OffPolicy, Rollout, WeightSync
    from torchtitan_flux.data.tasks import DigitsTask
    from torchtitan_flux.models import families, hf_weights
    from torchtitan_flux.rollout.rollouts import Rollouts

    config = families.config_from_hf_dir(model_dir)  # the trainer's model: torchtitan names, pushed as HF's
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    hf_weights.load_hf_weights(model, model_dir, config)
    model.to(device)
    jc = SimpleNamespace(
        rollout=Rollout(num_engines=num_engines, engine_threads=1, colocated=colocated, prompts_per_step=2,
                        max_new_tokens=8, engine_devices=list(engine_devices)),
        grpo=SimpleNamespace(group_size=2, temperature=1.0),
        weight_sync=WeightSync(async_weight_update=async_mode, timeout_seconds=timeout_s,
                               bucket_size_mb=bucket_size_mb, master_port=0, wire_dtype=wire_dtype, method=method),
        off_policy=OffPolicy(max_version_gap=max_version_gap), hf_assets_path=str(model_dir),
        dump_folder="", training=SimpleNamespace(steps=0, seq_len=128),
    )
    # no generation here, so no tokenizer
    r = Rollouts.start(jc, DigitsTask(), SimpleNamespace(), model, device=device, stops=SimpleNamespace(signal=None))
    try:
        for e in r.engines:
            e.checksum(timeout=120)  # serving its pipe
        r.syncer.connect()
    except BaseException:
        r.close()
        raise
    return r, model


def tiny_model_dir(out: Path) -> Path:
    from model_assets import build_model_dir

    return build_model_dir(out / "tiny-llama", flavor="tiny", seed=0)


@torch.no_grad()
def perturb(model, seed: int, fraction: float = 1.0) -> None:
    """A stand-in optimizer step: noise on every element, or on about ``fraction`` of them (sparse pushes)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=g) * 0.01
        if fraction < 1.0:
            noise *= torch.rand(p.shape, generator=g) < fraction
        p.add_(noise.to(p.device))


def pump_until(r, cond, timeout_s: float, what: str) -> bool:
    """Deliver engine events until ``cond()``; False (and a failed check) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            check(False, f"{what} within {timeout_s:g} s")
            return False
        r.pump.pump(0.02)
    return True


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def gpu_process_bytes() -> dict[int, int]:
    """Device memory per process from ``nvidia-smi`` (pid -> bytes); {} where it is missing or shows none (a
    container's pid namespace)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=15).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    got = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            got[int(pid)] = int(mib) * 2**20
    return got

