"""The real model (SmolLM2-135M-Instruct, ``scripts/get_real_model.sh``) behind the real engines: a vLLM CPU server
serves it, takes our pushes and passes the post-sync probe at every step of the capitals task, and both engines'
generation speeds on it are measured side by side.

Needs ``assets/smollm2-135m-instruct`` (skipped without it, failed under ``FLUX_REQUIRE_REAL_MODEL=1``, as CI sets)
and ``.venv-vllm`` (``need_vllm``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, free_port, need_vllm, read_metrics, run_train, wait_healthy

REAL = ROOT / "assets" / "smollm2-135m-instruct"
CONFIG = ROOT / "train_configs" / "smollm2_capitals_cpu.toml"


def need_real_model() -> Path:
    if not (REAL / "config.json").exists():
        why = f"{REAL} is missing: run scripts/get_real_model.sh"
        if os.environ.get("FLUX_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(why + " (FLUX_REQUIRE_REAL_MODEL=1)", pytrace=False)
        pytest.skip(why)
    return REAL


def _train(dump: Path, *extra: str) -> tuple[list[dict], dict]:
    run_train(dump, "--training.steps", "3", "--eval.at_start", "false",
              "--eval.every_steps", "0", "--weight_sync.probe_every", "1", "--weight_sync.async_weight_update", "false",
              "--off_policy.async_ratio", "0", *extra, timeout=600, config=CONFIG)
    return read_metrics(dump), json.loads((dump / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_serves_the_real_model_takes_pushes_and_passes_the_probe(tmp_path, monkeypatch):
    need_vllm()
    model = need_real_model()
    port = free_port()
    log_path = tmp_path / "vllm.log"
    env = {**os.environ, "VLLM_MAX_MODEL_LEN": "512"}
    env.pop("TORCHTITAN_FLUX_TOKEN", None)
    monkeypatch.delenv("TORCHTITAN_FLUX_TOKEN", raising=False)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", str(ROOT / "scripts/launch_vllm.sh"), str(model), str(port)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log_path, 400)
        rows, summary = _train(tmp_path / "vllm", "--rollout.engine", "vllm", "--rollout.urls",
                               f"http://127.0.0.1:{port}")
        # sparse pushes to the same server (a new group: dense first, then patches of what changed in bf16)
        s_rows, s_summary = _train(tmp_path / "vllm-sparse", "--rollout.engine", "vllm", "--rollout.urls",
                                   f"http://127.0.0.1:{port}", "--weight_sync.method", "sparse",
                                   "--weight_sync.wire_dtype", "bfloat16", "--optimizer.lr", "1e-6")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    assert summary["final_engine_version"] == 3 and summary["checksums_match"]
    # the probe ran after every push (a difference beyond probe_tolerance would have stopped the run)
    assert all(r["probe_engines_checked"] == 1 and r["probe_max_abs_diff"] < 0.1 for r in rows)
    assert s_summary["final_engine_version"] == 3 and s_summary["checksums_match"]
    assert all(r["probe_engines_checked"] == 1 and r["probe_max_abs_diff"] < 0.1 for r in s_rows)
    patched = [r["weight_patched_buckets"] for r in s_rows]
    assert max(patched) > 0, patched  # vLLM really took patches (bf16 at lr 1e-6: few elements change)
    print(f"\nreal model on vLLM, sparse bf16 pushes at lr 1e-6: bytes per push "
          f"{[r['weight_push_bytes'] for r in s_rows]}, changed {[r['weight_changed_fraction'] for r in s_rows]}")
    e_rows, e_summary = _train(tmp_path / "embedded")
    assert e_summary["checksums_match"]
    tps = {name: sum(r["completion_len_mean"] * 32 for r in rs) / sum(r["gen_time_s"] for r in rs)
           for name, rs in (("vllm", rows), ("embedded", e_rows))}
    print(f"\nreal model, generation tokens/s (32 completions x 12 tokens per step, 1 core each): "
          f"vllm {tps['vllm']:.0f}, embedded {tps['embedded']:.0f}, ratio {tps['vllm'] / tps['embedded']:.2f}")
