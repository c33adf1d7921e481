"""What a run's end reports: ``report.summary`` (summary.json) for the cases no run produces on this machine (no
engine, an engine with no checksum and no probe, a differing checksum), and the ``key=value`` lines of
``scripts/verify_grpo.py``, where ``checksums_equal`` means equal sha256 and nothing else."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
from conftest import ROOT

from torchtitan_flux.run import report

TRAINER_SUM = "a" * 64


class _Engine:
    def __init__(self, name, version, checksum, alive=True):
        self.name, self._v, self._c, self._alive = name, version, checksum, alive

    def checksum(self):
        return self._v, self._c

    def alive(self):
        return self._alive


def _summary(engines, probed_version=-1, final=5):
    syncer = SimpleNamespace(
        staging=SimpleNamespace(checksum=lambda: TRAINER_SUM), version=final,
        plan=SimpleNamespace(nbytes=10, buckets=[0]), bucket_bytes=10, metrics=lambda: {},
    )
    return report.summary(final, syncer, engines, probed_version, [0.0, 1.0, 2.0, 3.0], [])


def test_no_engine_is_neither_a_match_nor_verified():
    s = _summary([])
    assert s["checksums_match"] is False and s["all_engines_verified"] is False
    assert s["final_engine_version"] == -1 and s["checksums_compared"] == []


def test_an_engine_without_checksum_or_probe_is_not_verified(caplog):
    s = _summary([_Engine("e0", 5, TRAINER_SUM), _Engine("e1", 5, None)], probed_version=4)
    assert s["engines"]["e1"]["check"] == "not verified"
    assert s["checksums_match"] is False and s["all_engines_verified"] is False
    assert s["checksums_compared"] == ["e0"]


def test_probe_verifies_but_is_not_a_checksum_match():
    s = _summary([_Engine("e0", 5, None)], probed_version=5)
    assert s["engines"]["e0"]["check"] == "probe"
    assert s["all_engines_verified"] is True and s["checksums_match"] is False


def test_a_differing_or_stale_checksum_is_no_match():
    s = _summary([_Engine("e0", 5, "b" * 64), _Engine("e1", 4, TRAINER_SUM)])
    assert [v["check"] for v in s["engines"].values()] == ["checksum differs", "not verified"]
    assert s["checksums_match"] is False and s["all_engines_verified"] is False
    ok = _summary([_Engine("e0", 5, TRAINER_SUM), _Engine("e1", 5, TRAINER_SUM)])
    assert ok["checksums_match"] is True and ok["all_engines_verified"] is True and ok["final_engine_version"] == 5


@pytest.fixture(scope="module")
def verify():
    spec = importlib.util.spec_from_file_location("verify_grpo", ROOT / "scripts" / "verify_grpo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_summary(engines, probed_version=-1):
    s = _summary(engines, probed_version)
    s["rows"] = [{"weight_sync_s": 0.1, "weight_push_s": 0.2}] * 4
    return s


def test_verify_prints_checksums_equal_only_for_equal_sha256(verify):
    equal = _run_summary([_Engine("e0", 5, TRAINER_SUM)])
    probe_only = _run_summary([_Engine("e0", 5, None)], probed_version=5)
    differs = _run_summary([_Engine("e0", 5, "b" * 64)])

    ok, _, lines = verify.report_lines({"sync": equal, "async": equal})
    assert ok and "checksums_equal=1" in lines and "sync_checksums_equal=1" in lines

    # a probe pass verifies the run but its checksums are not "equal"
    ok, table, lines = verify.report_lines({"sync": equal, "async": probe_only})
    assert ok and "async_checksums_equal=0" in lines and "async_verified_by_probe=1" in lines
    assert lines[-1] == "checksums_equal=0" and "probe only" in table[-1]

    ok, _, lines = verify.report_lines({"sync": equal, "async": differs})
    assert not ok and "async_checksums_equal=0" in lines and "async_verified_by_probe=0" in lines
    assert lines[-1] == "checksums_equal=0"

    ok, _, lines = verify.report_lines({"sync": _run_summary([]), "async": None})
    assert not ok and "sync_checksums_equal=0" in lines and lines[-1] == "checksums_equal=0"


def test_a_metrics_write_that_fails_is_one_error_naming_the_file(tmp_path):
    """A full disk under metrics.jsonl (issue 27): ``MetricsWriteError`` naming the file and the step, which the
    trainer stops on like a failed checkpoint write (one ``stopped:`` line, the step checkpointed)."""
    import errno

    from torchtitan_flux.errors import MetricsWriteError
    from torchtitan_flux.run.metrics import MetricsWriter

    class FullDisk:
        name = str(tmp_path / "metrics.jsonl")

        def write(self, line):
            raise OSError(errno.ENOSPC, "No space left on device")

    w = MetricsWriter(str(tmp_path), total_steps=3)
    w.log(1, {"reward_mean": 0.5})
    w._f = FullDisk()
    with pytest.raises(MetricsWriteError, match=r"^cannot write .*metrics.jsonl at step 2: No space left on device; "):
        w.log(2, {"reward_mean": 0.5})
