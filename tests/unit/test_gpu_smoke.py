"""``scripts/gpu_smoke.py``'s runner: parts the budget leaves no time for are ``not_run`` (not a failure), unknown parts
are one usage error, and the part table holds what docs/gpu.md ("Run this first") promises. The parts themselves
run in CI's ``gpu_smoke_cpu`` stage (``scripts/gpu_smoke.sh --cpu``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT

SMOKE = ROOT / "scripts" / "gpu_smoke.py"


def _run(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SMOKE), "--cpu", "--out", str(tmp), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_a_part_the_budget_leaves_no_time_for_is_not_run_and_smoke_ok_stays_1(tmp_path):
    p = _run("--only", "fsdp,seqlock", "--budget", "5", tmp=tmp_path)
    lines = p.stdout.splitlines()
    assert p.returncode == 0, p.stdout + p.stderr
    assert "part_seqlock=not_run" in lines and "part_fsdp=not_run" in lines
    assert lines[-1] == "smoke_ok=1" and lines[0] == "device=cpu"
    assert "torch_has_set_timeout=1" in lines  # the project's torch runs torchtitan 0.3.0


def test_an_unknown_part_is_one_usage_error(tmp_path):
    p = _run("--only", "nope", tmp=tmp_path)
    assert p.returncode == 2 and "unknown parts ['nope']" in p.stderr


def test_the_parts_run_in_priority_order_with_cpu_twins_and_are_documented():
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_smoke

    table = gpu_smoke._parts(type("A", (), {"limit": 60.0, "steps": 20})(), Path("/nonexistent"), None)
    names = list(table)
    assert names[:6] == ["train", "seqlock", "sparse", "stream", "ipc", "fsdp"]  # docs/gpu.md's order
    assert all(gpu > 0 and least <= gpu for gpu, _, least, _ in table.values())
    gpu_only = {"profile", "train_cpu_engine", "train_medium_bf16", "train_graphs"}
    assert {n for n, (_, cpu, _, _) in table.items() if cpu == 0} == gpu_only
    assert set(gpu_smoke.ENGINE_PARTS) <= set(names) and set(gpu_smoke.TRAINING_PARTS) <= set(names)
    doc = (ROOT / "docs" / "gpu.md").read_text()
    section = doc[doc.index("## Run this first"):doc.index("## The first GPU runs")]
    assert all(n in section for n in names)


def test_a_torch_too_old_for_torchtitan_is_one_plain_line_naming_the_parts_it_fails(monkeypatch, capsys):
    """The lent GPU machines carry an older CUDA torch than torchtitan 0.3.0's 2.15: without
    ``torch.distributed.set_timeout`` the smoke says, in one line, that the training parts fail at it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_smoke
    import torch.distributed

    monkeypatch.delattr(torch.distributed, "set_timeout", raising=False)
    monkeypatch.setattr(gpu_smoke, "report", lambda k, v: print(f"{k}={v}"))
    gpu_smoke.torch_for_torchtitan(cpu=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "torch_has_set_timeout=0"
    assert len(lines) == 2 and "too old for torchtitan 0.3.0" in lines[1] and "set_timeout" in lines[1]
    assert all(part in lines[1] for part in gpu_smoke.TRAINING_PARTS)
