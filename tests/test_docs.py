"""Docs that are generated from code must not drift."""

import subprocess
import sys

from conftest import ROOT


def test_configuration_reference_is_up_to_date():
    proc = subprocess.run([sys.executable, "scripts/gen_config_docs.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_config_field_has_a_docstring():
    sys.path.insert(0, str(ROOT / "scripts"))
    import dataclasses

    import gen_config_docs

    from torchtitan_flux import config

    docs = gen_config_docs.field_docs()
    classes = [config.Grpo, config.Rollout, config.WeightSync, config.AdaptiveAsync, config.PhaseSchedule,
               config.PhaseSpec]
    missing = [f"{c.__name__}.{f.name}" for c in classes for f in dataclasses.fields(c) if not docs[c.__name__].get(f.name)]
    assert not missing, missing
