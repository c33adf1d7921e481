"""Process-tree helpers of the fault tests: a torchrun trainer that records every descendant it ever had, and
checks that none of them outlived it (orphans); the async livelock's reproduction (``run_held``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
from conftest import FIGURES, ROOT, read_metrics, torchrun_cmd

FAULT_INJECT = ROOT / "tests" / "fault_inject"  # sitecustomize.py: see its docstring


def gone(pid: int, create_time: float | None = None) -> bool:
    try:
        p = psutil.Process(pid)
        if create_time is not None and p.create_time() != create_time:
            return True  # pid reused
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(procs: dict[int, tuple[float, str]], timeout: float) -> list[str]:
    """The processes of ``procs`` (pid -> (create time, command)) still alive after up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [f"{pid}: {cmd}" for pid, (ct, cmd) in procs.items() if not gone(pid, ct)]
        if not alive or time.monotonic() > deadline:
            FIGURES["processes_checked"] += len(procs)
            FIGURES["orphans_found"] += len(alive)
            return alive
        time.sleep(0.1)


def complete_ckpts(dump: Path) -> list[int]:
    """Steps of the checkpoints a resume may load (those with DCP's ``.metadata``, written last)."""
    d = dump / "checkpoint"
    if not d.is_dir():
        return []
    out = []
    for f in d.iterdir():
        m = re.fullmatch(r"step-(\d+)", f.name)
        if m and (f / ".metadata").is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def count_steps_lost(interrupted_log: str, trained: int, resumed_at: int, graceful: bool) -> int:
    """The reliability figure "trained steps lost", counted from what the interrupted run did, not from the rule
    the loader applies: the steps it trained (``trained``, its last metrics row) or, after a kill, the newest step
    it logged as checkpointed ("checkpoint of step k saved" after a blocking periodic save, "... written" after
    the stop's save), minus the steps the resume kept (it starts at ``resumed_at``). Nonzero when the resume
    starts before that, e.g. from an older checkpoint, or after a graceful stop that did not checkpoint its last
    step."""
    written = [int(k) for k in re.findall(r"checkpoint of step (\d+) (?:saved|written)", interrupted_log)]
    if not graceful and not written:  # nothing to count against: 0 lost would be a guess, not a count
        raise AssertionError("the interrupted run's log has no 'checkpoint of step k saved/written' line, so the "
                             "steps lost cannot be counted:\n" + interrupted_log[-3000:])
    target = trained if graceful else max(written)
    lost = max(0, target - (resumed_at - 1))
    FIGURES["resumes"] += 1
    FIGURES["steps_lost"] += lost
    return lost


def start_step_of(output: str) -> int:
    """The step a run logged as its first ("Training starts at step k"); fails when the line is missing, so a
    resume check can never pass on a run that did not say where it started."""
    m = re.findall(r"Training starts at step (\d+)", output)
    assert m, "no 'Training starts at step k' line in the run's output:\n" + output[-3000:]
    assert len(set(m)) == 1, f"the run's ranks started at different steps: {m}"
    return int(m[0])


class Run:
    """A torchrun trainer in its own session, with every descendant it ever had recorded (``scan``: pid -> (create
    time, every distinct "[name] command line" it showed, joined by " | "))."""

    def __init__(self, dump: Path, log: Path, *overrides: str, faults: dict[str, str] | None = None, nproc: int = 1):
        self.log = log
        env = dict(os.environ)
        if faults:
            env.update(faults)
            env["PYTHONPATH"] = os.pathsep.join([str(FAULT_INJECT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        with open(log, "w") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                torchrun_cmd(dump, *overrides, nproc=nproc), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, env=env,
            )
        self.seen: dict[int, tuple[float, str]] = {}
        self.engine_pids: set[int] = set()

    def scan(self) -> None:
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for c in kids:
            try:
                name = c.name()
                if name.startswith("flux-"):  # an engine names itself once it runs (see engine.embedded)
                    self.engine_pids.add(c.pid)
                # every name it showed: processes rename themselves after they start (engines, vLLM's engine core),
                # and an exiting (or still exec-ing) process shows an empty command line, so the latest alone can
                # hide what it was (CI saw vLLM's server last as "[python] ")
                shown = f"[{name}] " + " ".join(c.cmdline())
                created, before = self.seen.get(c.pid, (None, ""))
                if created != c.create_time():  # new, or a reused pid
                    self.seen[c.pid] = (c.create_time(), shown)
                elif shown not in before.split(" | "):
                    self.seen[c.pid] = (created, f"{before} | {shown}")
            except psutil.Error:
                pass

    @property
    def engines(self) -> list[int]:
        return sorted(self.engine_pids)

    def wait_for(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            self.scan()
            if self.proc.poll() is not None:
                raise AssertionError(f"trainer exited ({self.proc.returncode}) before {what}:\n"
                                     f"{self.log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.05)
        self.scan()

    def sigterm_stops_within(self, seconds: float) -> str:
        """SIGTERM the trainer; it must exit non-zero within ``seconds``, leaving no process behind. Its log."""
        t0 = time.monotonic()
        os.kill(self.proc.pid, signal.SIGTERM)
        assert self.proc.wait(60) != 0
        took = time.monotonic() - t0
        assert not wait_gone(self.seen, 10.0), "processes outlived the SIGTERMed trainer"
        log = self.log.read_text()
        assert took < seconds, f"the stop took {took:.1f} s: {log[-3000:]}"
        return log

    def start_step(self) -> int | None:
        m = re.search(r"Training starts at step (\d+)", self.log.read_text())
        return int(m.group(1)) if m else None


def run_held(dump: Path, *overrides: str, nproc: int = 1, hold: str = "5:30", timeout: float = 180.0):
    """The async livelock's reproduction (``tests/integration/test_livelock.py``): a torchrun run of the debug
    config for 12 steps, async, ``max_version_gap`` 1, with the first push of a version >= 5 held in flight until
    the two due steps after it were coalesced (``FLUX_FAULT_PUSH_HOLD``, at most 30 s), so the next step needs a
    version newer than the one staged. Killed (its whole process group) and failed past ``timeout``; returns the
    metrics rows and the summary of a run that finished."""
    env = {**os.environ, "FLUX_FAULT_PUSH_HOLD": hold,
           "PYTHONPATH": os.pathsep.join([str(FAULT_INJECT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    cmd = torchrun_cmd(dump, "--training.steps", "12", "--weight_sync.async_weight_update", "true",
                       "--off_policy.async_ratio", "1", "--off_policy.max_version_gap", "1", *overrides, nproc=nproc)
    log = dump.parent / f"{dump.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        steps = [r["step"] for r in read_metrics(dump)] if (dump / "metrics.jsonl").exists() else []
        raise AssertionError(f"livelock: the run did not finish within {timeout} s (steps done: {steps}):\n"
                             f"{log.read_text()[-3000:]}") from None
    assert rc == 0, log.read_text()[-4000:]
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["weight_coalesced"] >= 2 and rows[-1]["weight_catch_ups"] >= 1, rows[-1]
    assert all(r["version_gap_max"] <= 1 for r in rows)
    summary = json.loads((dump / "summary.json").read_text())
    assert summary["final_engine_version"] == 12
    return rows, summary
