"""The post-sync probe stops a real run (torchrun, embedded engine) whose engine does not serve the pushed policy.

The fault (``tests/fault_inject/sitecustomize.py``, ``FLUX_FAULT_ENGINE_WEIGHTS``) makes the engine compute with
other weights than it received, from version 3 on; the bytes it holds, and so its checksum, stay right: what only
the probe can catch. With a probe every 2 steps, the probe of step 2 passes (difference 0: the same forward on the
same weights) and the probe of step 4 stops the run with one ``error: probe: ...`` line naming the engine, the
version and the worst token, exit code 1, before step 4 is logged. A dropped tensor is caught at the default
tolerance; a bf16 mix-up moves the debug model's probe by only 0.006-0.011, so it is caught at a tolerance below
that (1e-3, what an fp32 engine allows), not at the default 0.1 (docs/running.md, "Post-sync probe").
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from _procs import FAULT_INJECT
from conftest import ROOT, torchrun_cmd

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("fault,tolerance", [
    ("3:drop:model.norm.weight", "0.1"),  # the default tolerance
    ("3:bf16", "0.001"),
], ids=["dropped_tensor", "bf16_mixed"])
def test_an_engine_serving_other_weights_stops_the_run_at_the_next_probe(tiny_model_dir, tmp_path, fault, tolerance):
    dump = tmp_path / "run"
    env = {**os.environ, "FLUX_FAULT_ENGINE_WEIGHTS": fault,
           "PYTHONPATH": os.pathsep.join([str(FAULT_INJECT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(torchrun_cmd(dump, "--training.steps", "8", "--weight_sync.probe_every", "2",
                                    "--weight_sync.probe_tolerance", tolerance),
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode != 0, p.stderr[-3000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, p.stderr[-3000:]
    m = re.fullmatch(r"error: probe: engine engine0 at version 4 does not serve the trainer's policy: max \|logprob "
                     r"difference\| (\S+) > weight_sync\.probe_tolerance (\S+), worst at probe token \d+ \(id \d+\).*",
                     lines[0])
    assert m and float(m.group(1)) > float(tolerance) and m.group(2) == f"{float(tolerance):g}", lines[0]
    assert "exitcode  : 1" in p.stderr  # the trainer's own exit code, in torchrun's summary
    assert not [x for x in p.stderr.splitlines() if re.match(r'\s*File ".*torchtitan_flux/', x)]  # no traceback of ours
    rows = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # step 4 stopped at its probe, before its row
    assert rows[1]["probe_engines_checked"] == 1 and rows[1]["probe_max_abs_diff"] == 0.0  # before the fault
