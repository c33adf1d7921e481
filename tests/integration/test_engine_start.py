"""How embedded engines start (``engine.forkserver``): the start method and its environment override, the entry
point's early start of the fork server (and when it skips it), and that an engine comes from that one server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from _procs import wait_gone
from conftest import DEBUG_TOML, ROOT

from torchtitan_flux.engine import forkserver
from torchtitan_flux.train import _starts_embedded_engines


def test_start_method_default_and_override(monkeypatch):
    monkeypatch.delenv(forkserver.START_METHOD_ENV, raising=False)
    assert forkserver.start_method() == "forkserver"  # Linux
    monkeypatch.setenv(forkserver.START_METHOD_ENV, "spawn")
    assert forkserver.start_method() == "spawn"
    assert forkserver.engine_context().get_start_method() == "spawn"
    assert forkserver.prestart_engine_server() is False
    monkeypatch.setenv(forkserver.START_METHOD_ENV, " ForkServer ")
    assert forkserver.start_method() == "forkserver"
    monkeypatch.setenv(forkserver.START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match="TORCHTITAN_FLUX_ENGINE_START='fork': allowed values are 'forkserver' and 'spawn'"):
        forkserver.start_method()


def test_bad_start_method_fails_before_any_work(tmp_path):
    env = {**os.environ, forkserver.START_METHOD_ENV: "thread"}
    env.pop("RANK", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan_flux.train", "--job.config_file", str(DEBUG_TOML),
         "--job.dump_folder", str(tmp_path / "run")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2  # bad input; before (issue 27's second sweep): exit 1, no "error:" prefix
    assert proc.stderr.splitlines()[-1] == ("error: TORCHTITAN_FLUX_ENGINE_START='thread': allowed values are "
                                            "'forkserver' and 'spawn'")
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize("sig,after_s", [("SIGINT", 1.0), ("SIGTERM", 1.0), ("SIGINT", 0.3)])
def test_a_signal_while_starting_is_one_line(tmp_path, sig, after_s):
    """A Ctrl-C (or SIGTERM) while the entry point still imports torch: one ``stopped:`` line, exit 1, nothing
    left running. Before (issue 27's second sweep): SIGINT printed a KeyboardInterrupt traceback from inside
    whichever import it landed in; SIGTERM ended the process with no word. Until 2026-11-26 the line came from an
    exception raised where the signal landed: inside numpy's C import (a loaded machine) it became an unrelated
    ``ImportError`` traceback (seen under pytest-xdist); now the handler writes the line and exits at once."""
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_flux.train", "--job.config_file", str(DEBUG_TOML),
         "--job.dump_folder", str(tmp_path / "run")], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)
    proc.send_signal(getattr(signal, sig))
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"stopped: received {sig}"), err[-3000:]


def test_entry_point_peeks_at_the_engine_kind(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    toml = str(DEBUG_TOML)
    assert _starts_embedded_engines(["--job.config_file", toml])  # debug config: embedded
    assert _starts_embedded_engines([])  # the default engine
    assert not _starts_embedded_engines(["--job.config_file", toml, "--rollout.engine", "vllm"])
    assert not _starts_embedded_engines(["--rollout.engine=sglang", "--job.config_file", toml])
    assert _starts_embedded_engines(["--rollout.engine=embedded"])
    remote = tmp_path / "remote.toml"
    remote.write_text('[rollout]\nengine = "vllm"\n')
    assert not _starts_embedded_engines([f"--job.config_file={remote}"])
    assert not _starts_embedded_engines(["--job.config_file", str(tmp_path / "missing.toml")])  # parse reports it
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout\n")
    assert not _starts_embedded_engines(["--job.config_file", str(bad)])
    monkeypatch.setenv("RANK", "1")  # only global rank 0 starts engines
    assert not _starts_embedded_engines(["--job.config_file", toml])


def test_one_prestarted_server_forks_every_engine(tiny_model_dir):
    script = textwrap.dedent("""
        import json, queue, sys
        import psutil
        from torchtitan_flux.engine.forkserver import prestart_engine_server
        from torchtitan_flux.engine.embedded import EmbeddedEngine
        if __name__ == "__main__":
            assert prestart_engine_server() and prestart_engine_server()
            engines = [EmbeddedEngine(f"engine{i}", sys.argv[1], 1, queue.Queue()) for i in range(2)]
            for e in engines:
                e.start()
            for e in engines:
                e.checksum(timeout=60)
            # listed once it has served: right after the start its /proc cmdline can read empty (mid-exec)
            servers = [(c.pid, c.create_time()) for c in psutil.Process().children()
                       if "forkserver" in " ".join(c.cmdline())]
            print(json.dumps([servers, [psutil.Process(e.pid).parent().pid for e in engines],
                              [psutil.Process(e.pid).name() for e in engines]]))
            for e in engines:
                e.close()
    """)
    env = {k: v for k, v in os.environ.items() if k != forkserver.START_METHOD_ENV}
    proc = subprocess.run([sys.executable, "-c", script, str(tiny_model_dir)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    servers, parents, names = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(servers) == 1 and parents == [servers[0][0]] * 2
    assert names == ["flux-engine0", "flux-engine1"]
    (pid, created), = servers
    assert not wait_gone({pid: (created, "fork server")}, 5.0), "the fork server outlived its starter"


def test_a_launched_server_that_exits_is_reported_with_its_code_and_last_error_line(tiny_model_dir, tmp_path):
    """``rollout.launch``: a server that exits while starting is named with its exit code and the line of its log
    that says why (here: a Python without vLLM), in one line, and the entry point prints it as one ``error:``
    line (no traceback). Before: a 2000-character log tail, or "cannot reach the vLLM server ... Is it running?"."""
    from torchtitan_flux.errors import EngineStartError
    from torchtitan_flux.engine.vllm_launch import last_error_line, launch_servers
    from torchtitan_flux.patches import apply_patches
    from torchtitan_flux.train import _report

    apply_patches()  # _report imports the trainer (torchtitan)

    with pytest.raises(EngineStartError) as e:
        launch_servers(1, tiny_model_dir, python=sys.executable, log_dir=tmp_path, timeout_s=60)
    msg = str(e.value)
    assert "\n" not in msg
    assert "exited with code 1 before it was healthy: " in msg and "No module named 'vllm'" in msg
    assert msg.endswith(f"(full log: {tmp_path / 'vllm_server0.log'})")
    assert last_error_line("loading...\nTraceback (most recent call last):\n  x\nValueError: head size 16\nbye\n") \
        == "ValueError: head size 16"
    assert last_error_line("") == "(empty log)"
    assert _report(e.value) == 1


def test_engine_start_error_is_one_error_line(capsys):
    from torchtitan_flux.errors import EngineStartError
    from torchtitan_flux.patches import apply_patches
    from torchtitan_flux.train import _report

    apply_patches()  # _report imports the trainer (torchtitan)
    try:
        raise EngineStartError("engine0: cannot reach the vLLM server at http://127.0.0.1:1")
    except EngineStartError as e:
        assert _report(e) == 1
    err = capsys.readouterr().err
    assert err == "error: engine0: cannot reach the vLLM server at http://127.0.0.1:1\n"
