"""Issue 18 through the real ``torchrun -m torchtitan_flux.train`` command: an input error is one ``error:`` line
from the child (exit code 2, no traceback from our code), and a diverged run stops with "loss is not finite"."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _run(tmp_path, *overrides, timeout=240):
    cmd = [TORCHRUN, "--nproc_per_node", "1", "-m", "torchtitan_flux.train", "--job.config_file",
           "train_configs/debug_cpu.toml", "--job.dump_folder", str(tmp_path / "run"), *overrides]
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("overrides,line", [
    (("--training.steps", "0"), "error: training.steps = 0 is out of range; allowed: an integer >= 1"),
    (("--weight_sync.interval", "5"),
     "error: weight_sync.interval = 5 is out of range; allowed: <= adaptive_async.max_version_gap + 1"),
    (("--job.config_file", "train_configs/debug_cpu.toml"),
     "error: --job.config_file is given 2 times; allowed: once"),
])
def test_input_error_is_one_line_exit_2(tmp_path, tiny_model_dir, overrides, line):
    p = _run(tmp_path, *overrides, timeout=120)
    out = p.stdout + p.stderr
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(line), out[-3000:]
    assert "exitcode: 2" in out, out[-3000:]  # the child's exit code, as torchrun reports it
    assert 'torchtitan_flux/' not in "".join(ln for ln in out.splitlines() if ln.lstrip().startswith("File ")), out


@pytest.mark.slow
def test_non_finite_loss_stops_before_the_optimizer_step(tmp_path, tiny_model_dir):
    p = _run(tmp_path, "--training.steps", "4", "--optimizer.lr", "1e30")
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert "error: loss is not finite at step 2" in out, out[-3000:]
    rows = open(tmp_path / "run" / "metrics.jsonl").read().splitlines()
    assert len(rows) == 1  # step 1 completed and logged; step 2 took no optimizer step
