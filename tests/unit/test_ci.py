"""CI's stages (``.ci/run``): the real-vLLM stage fails, instead of skipping, when ``.venv-vllm`` is missing or
cannot import vLLM (a stage whose every test skipped would pass without testing anything); and ``.ci/run`` itself,
run on a copy of the repository whose scripts and Pythons are stand-ins that record their calls: every stage runs,
in order, a failing stage ends the run with its status, and a ``.venv-vllm`` that cannot import vLLM stops it before
the vLLM stage."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REQUIRE_VLLM_ENV, ROOT, need_vllm


def _outcome(python) -> tuple[str, bool]:
    """How ``need_vllm(python)`` ends a test: ("Skipped" | "Failed", whether it says why). Caught here, so that a
    skip cannot escape as this test's own skip."""
    with pytest.raises(BaseException) as e:
        need_vllm(python)
    return e.type.__name__, "is absent" in str(e.value)


def test_without_vllm_a_vllm_test_skips_locally_but_fails_under_ci(tmp_path, monkeypatch):
    missing = tmp_path / ".venv-vllm" / "bin" / "python"
    monkeypatch.delenv(REQUIRE_VLLM_ENV, raising=False)
    assert _outcome(missing) == ("Skipped", True)
    monkeypatch.setenv(REQUIRE_VLLM_ENV, "1")
    assert _outcome(missing) == ("Failed", True)


def test_a_venv_that_cannot_import_vllm_fails_under_ci(tmp_path, monkeypatch):
    broken = tmp_path / "python"  # a python that exists but has no vllm, as a half-installed .venv-vllm
    broken.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import no_such_module_vllm_stand_in' \"$@\"\n")
    broken.chmod(0o755)
    monkeypatch.setenv(REQUIRE_VLLM_ENV, "1")
    with pytest.raises(BaseException) as e:  # a skip must not escape as this test's own skip
        need_vllm(broken)
    assert e.type is pytest.fail.Exception and "cannot import vllm" in str(e.value), (e.type, e.value)


def test_ci_runs_the_vllm_stage_with_the_requirement_and_checks_the_import_first():
    lines = [x.strip() for x in (ROOT / ".ci" / "run").read_text().splitlines() if not x.strip().startswith("#")]
    stage = [x for x in lines if re.search(r"pytest .*-m vllm\b", x)]
    assert stage and all(x.startswith(f"{REQUIRE_VLLM_ENV}=1 ") for x in stage), stage
    check = [i for i, x in enumerate(lines) if x.startswith('.venv-vllm/bin/python -c "import vllm"')]
    assert check and check[0] < lines.index(stage[0]) and "exit 1" in lines[check[0]]
    assert lines[0] == "set -euo pipefail" or "set -euo pipefail" in lines  # a failing step ends the run
    # every file with vLLM tests is in the stage, and goes through need_vllm (a bare pytest.skip on a missing
    # .venv-vllm would bypass CI's rule; the real-model test's own skip becomes a failure under
    # FLUX_REQUIRE_REAL_MODEL=1, which the stage sets)
    ci = (ROOT / ".ci" / "run").read_text()
    start = ci.rindex("\n", 0, ci.index("stage vllm_tests")) + 1
    stage_text = ci[start:].split("\nstage ", 1)[0]  # the stage's command, over its continuation lines
    files = sorted(p for p in (ROOT / "tests" / "integration").glob("test_*.py") if "mark.vllm" in p.read_text())
    assert len(files) >= 4, files
    for path in files:
        src = path.read_text()
        assert f"tests/integration/{path.name}" in stage_text, f"{path.name} is not in CI's vLLM stage"
        assert "need_vllm()" in src, path.name
        assert "pytest.skip(" not in src or ("FLUX_REQUIRE_REAL_MODEL" in src and "FLUX_REQUIRE_REAL_MODEL=1" in
                                             stage_text), path.name


def test_the_default_suite_reads_only_what_setup_builds():
    """CI runs the default suite after scripts/setup.sh alone (which builds assets/tiny-llama and its chat variant,
    assets/tiny-chat); the real model
    (scripts/get_real_model.sh) comes later, for the slow and vLLM stages. A unit test that read it passed on a
    machine that had it and failed in CI (2026-11-27): the unit tests' ChatML tokenizer is tests/fakes/'s."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    built = set(re.findall(r"assets/([\w.-]+)", setup))
    assert built == {"tiny-llama", "tiny-chat"}, built
    for path in sorted([*(ROOT / "tests" / "unit").glob("*.py"), ROOT / "tests" / "conftest.py"]):
        for name in re.findall(r'ROOT\s*/\s*"assets"\s*/\s*"([^"]+)"', path.read_text()):
            assert name in built, f"{path.name} reads assets/{name}, which scripts/setup.sh does not build"


def test_ci_collects_the_old_torch_tests_as_their_venv_would():
    """scripts/check_old_torch.sh's venv (torch 2.3.1, no pytest-xdist, no torchtitan) is too big to build in CI; CI
    runs the script's pytest invocations on .venv instead, where an addopts or import change would show."""
    lines = [x.strip() for x in (ROOT / ".ci" / "run").read_text().splitlines() if not x.strip().startswith("#")]
    assert "stage old_torch_collect scripts/check_old_torch.sh --collect-only" in lines
    script = (ROOT / "scripts" / "check_old_torch.sh").read_text()
    assert "PYTEST=(-m pytest -q -p no:cacheprovider -o addopts=)" in script  # one invocation for both uses
    for path in re.findall(r"tests/\S+\.py", script):
        assert (ROOT / path).is_file(), f"check_old_torch.sh names {path}, which is gone"


def _ci_copy(tmp_path, fail: str | None = None, vllm_imports: bool = True):
    """A copy of ``.ci/run`` beside stand-ins for every script and Python it calls: each appends its name and
    arguments to ``calls``, exits 0, or 3 where ``fail`` is a word of its command line."""
    root = tmp_path / "repo"
    (root / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", root / ".ci" / "run")
    calls = tmp_path / "calls"
    stand_in = (f"#!/bin/sh\necho \"$(basename $0) $*\" >> {calls}\n"
                f"case \" $* \" in *\" {fail} \"*) exit 3;; esac\n" if fail else
                f"#!/bin/sh\necho \"$(basename $0) $*\" >> {calls}\n")
    names = set(re.findall(r"scripts/(\w+)\.sh", (ROOT / ".ci" / "run").read_text())) | {"setup", "setup_vllm",
                                                                                        "get_real_model", "setup_trl"}
    for path in [*(f"scripts/{n}.sh" for n in names), ".venv/bin/python"]:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(stand_in)
        (root / path).chmod(0o755)
    vllm = root / ".venv-vllm" / "bin" / "python"
    vllm.parent.mkdir(parents=True)
    vllm.write_text(f"#!/bin/sh\necho \"venv-vllm $*\" >> {calls}\nexit {0 if vllm_imports else 1}\n")
    vllm.chmod(0o755)
    proc = subprocess.run(["bash", str(root / ".ci" / "run")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": os.environ["PATH"]})
    return proc, (calls.read_text().splitlines() if calls.exists() else [])


def test_ci_runs_every_stage_in_order_and_a_failing_stage_ends_it(tmp_path):
    proc, calls = _ci_copy(tmp_path / "ok")
    assert proc.returncode == 0, proc.stderr
    stages = re.findall(r"^ci: (\w+) \d+ s", proc.stdout, re.M)
    assert stages == re.findall(r"^(?:FLUX_\S+ )*stage (\w+)", (ROOT / ".ci" / "run").read_text(), re.M), stages
    assert "passed in" in proc.stdout.splitlines()[-1]
    assert any(c.startswith("python -m pytest -q -n 2 -m not slow tests") for c in calls), calls  # the README's
    # a failing stage (the default suite) ends the run with its status; nothing after it runs
    proc, calls = _ci_copy(tmp_path / "fail", fail="slow")
    assert proc.returncode == 3 and "passed in" not in proc.stdout
    assert not any("bench_quick" in c for c in calls) and re.findall(r"^ci: (\w+)", proc.stdout, re.M) == ["setup"]


def test_ci_stops_before_the_vllm_stage_when_vllm_does_not_import(tmp_path):
    proc, calls = _ci_copy(tmp_path, vllm_imports=False)
    assert proc.returncode == 1 and "cannot import vllm" in proc.stderr
    assert not any("-m vllm" in c for c in calls) and not any("bench_quick" in c for c in calls)
