"""Shared fixtures: the tiny local model (built once per session) and a torchrun helper."""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"  # the shared helpers; unit/ and integration/ hold the test files, fakes/ the stand-ins
DEBUG_TOML = ROOT / "train_configs" / "debug_cpu.toml"


# Reliability figures (docs/reliability.md), counted by the fault tests as they check: weight checksums compared
# between an engine and the trainer, processes checked for orphans and orphans found. Each test's counts travel on
# its teardown report (so pytest-xdist workers' counts reach the controller) and are summed there; printed after
# the run.
FIGURES: collections.Counter = collections.Counter()  # this process's counts (a worker's, under -n)
_TOTALS: collections.Counter = collections.Counter()  # every process's, summed from the reports


@pytest.fixture(autouse=True)
def _figures_of_this_test(request):
    before = FIGURES.copy()
    yield
    request.node.user_properties.append(("flux_figures", dict(FIGURES - before)))


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        for key, value in report.user_properties:
            if key == "flux_figures":
                _TOTALS.update(value)


def pytest_terminal_summary(terminalreporter):
    faults = [r for r in terminalreporter.stats.get("passed", []) if r.when == "call" and "faults" in r.keywords]
    if faults:
        _TOTALS["fault_tests_passed"] = len(faults)
    if _TOTALS:
        terminalreporter.write_line("reliability figures: " + ", ".join(f"{k}={v}" for k, v in sorted(_TOTALS.items())))


@pytest.fixture(scope="session")
def chatml_dir(tmp_path_factory):
    """A ChatML tokenizer folder in SmolLM2's layout (tests/fakes/chatml_tokenizer.py), built once per session."""
    from fakes.chatml_tokenizer import write_chatml_tokenizer
    return write_chatml_tokenizer(tmp_path_factory.mktemp("chatml"))


VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
REQUIRE_VLLM_ENV = "FLUX_REQUIRE_VLLM"  # CI's vLLM stage sets it to 1: a missing or broken .venv-vllm fails there


def vllm_venv_problem(python: Path = VLLM_PY) -> str | None:
    """Why the real-vLLM tests cannot run (None: they can): ``python`` is missing, or cannot import vllm."""
    if not python.exists():
        return f"{python.parent.parent} is absent: run scripts/setup_vllm.sh to test against a real vLLM server"
    p = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"{python} cannot import vllm ({last}): rerun scripts/setup_vllm.sh"
    return None


_VLLM_PROBLEM: dict[str, str | None] = {}


def need_vllm(python: Path = VLLM_PY) -> None:
    """Call first in every real-vLLM test or fixture: skips it when ``.venv-vllm`` cannot serve (a local run
    without vLLM), but FAILS it when ``FLUX_REQUIRE_VLLM=1`` (CI's vLLM stage: a stage that only skipped would
    pass without testing anything)."""
    key = str(python)
    if key not in _VLLM_PROBLEM:
        _VLLM_PROBLEM[key] = vllm_venv_problem(python)
    problem = _VLLM_PROBLEM[key]
    if problem is None:
        return
    if os.environ.get(REQUIRE_VLLM_ENV) == "1":
        pytest.fail(f"{problem} ({REQUIRE_VLLM_ENV}=1: this stage must run the vLLM tests, not skip them)",
                    pytrace=False)
    pytest.skip(problem)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from model_assets import build_model_dir

    return Path(build_model_dir(ROOT / "assets" / "tiny-llama", flavor="tiny", seed=0))


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory) -> Path:
    """The "small" flavor (head_dim 32: vLLM's CPU attention refuses the tiny flavor's 16), built per worker."""
    from model_assets import build_model_dir

    return Path(build_model_dir(tmp_path_factory.mktemp("flux_small"), flavor="small", seed=0))


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, limit_s: float) -> None:
    """Poll ``{url}/health`` until 200; AssertionError with the log's tail if ``proc`` exits or ``limit_s`` passes."""
    import httpx

    t0 = time.monotonic()
    while True:
        if proc.poll() is not None or time.monotonic() - t0 > limit_s:
            raise AssertionError(f"server at {url} did not come up:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(dump: Path, *overrides: str, nproc: int = 1, config: Path = DEBUG_TOML) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "-m", "torchtitan_flux.train", "--job.config_file", str(config),
        "--job.dump_folder", str(dump), *overrides,
    ]


def run_train(dump: Path, *overrides: str, nproc: int = 1, timeout: float = 240,
              config: Path = DEBUG_TOML) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        torchrun_cmd(dump, *overrides, nproc=nproc, config=config), cwd=ROOT, capture_output=True, text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(dump: Path) -> list[dict]:
    """metrics.jsonl rows; for a resumed run the last row of each step wins."""
    rows: dict[int, dict] = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows[r["step"]] = r
    return [rows[k] for k in sorted(rows)]


@pytest.fixture
def harness_factory(tiny_model_dir):
    """Build ``_sync_harness.Harness`` rigs (rank 0's ``Rollouts``: real engine processes, scheduler, WeightSyncer);
    closed after."""
    from _sync_harness import Harness

    made: list = []

    def make(**kw):
        h = Harness(tiny_model_dir, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@pytest.fixture(autouse=True)
def _no_cuda_env(monkeypatch):
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
