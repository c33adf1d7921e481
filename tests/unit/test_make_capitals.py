"""``scripts/make_capitals.py`` (the real-model task's data) still runs and writes exactly the committed files."""

import subprocess
import sys

from conftest import ROOT


def test_make_capitals_regenerates_the_committed_dataset(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts/make_capitals.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for split in ("train", "test"):
        assert (tmp_path / f"{split}.jsonl").read_text() == (ROOT / "data/capitals" / f"{split}.jsonl").read_text()
