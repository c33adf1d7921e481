"""Docs that are generated from code must not drift, and the tests they cite must exist."""

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
    classes = list({**config.SECTIONS, **config.ADDED_TO_TORCHTITAN}.values())
    for c in classes:  # appends nested tables as it goes (phase_schedule, then its phases)
        classes += [f.type for f in dataclasses.fields(c) if dataclasses.is_dataclass(f.type) and f.type not in classes]
    assert {config.OffPolicy, config.Eval, config.MetricsAdditions, config.CheckpointAdditions, config.PhaseSpec} <= set(classes)
    missing = [f"{c.__name__}.{f.name}" for c in classes for f in dataclasses.fields(c) if not docs[c.__name__].get(f.name)]
    assert not missing, missing


def test_the_reference_lists_torchtitans_settable_fields_and_the_0_2_2_keys():
    """docs/configuration.md documents all of ``GRPOTrainer.Config`` a TOML sets: beside our sections, each settable
    field of torchtitan 0.3.0's sections under its heading (type, default, its docstring from torchtitan's source),
    every key ``config_file`` translates, and that ``--module/--config`` are not read. Mutations: the generator
    without ``torchtitan_sections``; a field's docstring not read (``_doc`` returning "")."""
    import re

    from torchtitan_flux.run import config_file

    text = (ROOT / "docs" / "configuration.md").read_text()
    head, _, torchtitan = text.partition("\n## torchtitan 0.3.0's sections\n")
    assert "\n## `[grpo]`\n" in head and "`--module` / `--config` flags" in torchtitan
    compile_ = torchtitan.split("\n### `[compile]`\n", 1)[1].split("\n### ", 1)[0]
    assert re.search(r"^\| `enable` \| bool \| `false` \| Whether to apply torch.compile \|$", compile_, re.M)
    optimizer = torchtitan.split("\n### `[optimizer]`\n", 1)[1].split("\n### ", 1)[0]
    assert re.search(r"^\| `param_groups` \| list\[ParamGroupConfig\] \| `\[\]` \| Per-parameter-group", optimizer, re.M)
    metrics = torchtitan.split("\n### `[metrics]`\n", 1)[1].split("\n### ", 1)[0]
    assert "| `log_freq` |" in metrics and "log_completions_every" not in metrics  # ours: in our [metrics] above
    legacy = torchtitan.split("\n## Keys of torchtitan 0.2.2's layout\n", 1)[1]
    for key in [*config_file.LEGACY, *config_file.FIXED, "profiling.<field>", "activation_checkpoint.mode"]:
        assert f"| `{key}` |" in legacy, key


def test_every_rollout_field_is_in_exactly_one_group_under_its_heading():
    """``Rollout``'s fields are grouped by job (``# -- Title: description`` lines in config.py): every field is in
    exactly one group, and docs/configuration.md's ``[rollout]`` section has each group's heading with exactly its
    fields' rows under it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import dataclasses
    import re

    import gen_config_docs

    from torchtitan_flux import config

    groups = gen_config_docs.field_groups()["Rollout"]
    titles = [t for t, _, _ in groups]
    assert len(groups) >= 2 and len(set(titles)) == len(titles), titles
    assert all(desc and names for _, desc, names in groups), groups
    grouped = [n for _, _, names in groups for n in names]
    fields = [f.name for f in dataclasses.fields(config.Rollout)]
    ungrouped = sorted(set(fields) - set(grouped))
    twice = sorted({n for n in grouped if grouped.count(n) > 1})
    assert not ungrouped and not twice and len(grouped) == len(fields), (ungrouped, twice)

    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text.split("\n## `[rollout]`\n", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^### (.+)$", section, flags=re.M)  # [preamble, title, body, title, body, ...]
    assert parts[1::2] == titles, parts[1::2]
    for (title, desc, names), body in zip(groups, parts[2::2]):
        assert desc[:1].upper() + desc[1:] in body, title
        assert re.findall(r"^\| `(\w+)` \|", body, re.M) == names, title


def test_every_test_the_docs_name_exists():
    """README.md, CHANGELOG.md and docs/*.md back their claims with ``tests/<unit|integration>/test_x.py::test_y``
    references: each must name a test that exists (a renamed or removed test would leave a claim unbacked)."""
    import re

    tests = {f.name: set(re.findall(r"^\s*(?:async )?def (test_\w+)", f.read_text(), re.M))
             for f in (ROOT / "tests").rglob("test_*.py")}
    missing = []
    for doc in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"(test_\w+\.py)(?:::(test_\w+))?", doc.read_text()):
            f, t = m.group(1), m.group(2)
            if f not in tests or (t and t not in tests[f]):
                missing.append(f"{doc.name}: {m.group(0)}")
    assert not missing, missing


def test_the_tried_table_counts_what_the_tests_run():
    """docs/reliability.md's "Bad inputs and faults tried" table: each row's ``tried`` equals the number of test
    cases pytest collects for the tests it names (parametrized cases one by one), and the rows add up to at least
    the 94 kinds of bad input and fault of the 2026-11-23 sweep."""
    import re

    text = (ROOT / "docs" / "reliability.md").read_text()
    section = text.split("## Bad inputs and faults tried", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| group")]
    parsed = []
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        parsed.append((cells[0], int(cells[1]), re.findall(r"(test_\w+\.py::test_\w+)", cells[3])))
    ids = sorted({i for _, _, tests in parsed for i in tests})
    where = {f.name: f.relative_to(ROOT) for f in (ROOT / "tests").rglob("test_*.py")}  # under unit/ or integration/
    args = [f"{where[f]}::{t}" for f, t in (i.split("::") for i in ids)]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    collected = [ln.split("[")[0].rsplit("/", 1)[-1] for ln in out.stdout.splitlines() if "::" in ln]
    assert collected, out.stdout[-2000:] + out.stderr[-2000:]
    for group, tried, tests in parsed:
        assert tests, group
        assert sum(collected.count(t) for t in tests) == tried, (group, tried, {t: collected.count(t) for t in tests})
    assert sum(t for _, t, _ in parsed) >= 94


def test_every_package_is_in_pyproject_packages():
    """A non-editable install ships only the packages pyproject.toml lists (weight_sync was once missing)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "torchtitan_flux").rglob("*.py")
             if "__pycache__" not in p.parts}  # every folder with code, with or without an __init__.py
    assert found <= listed, sorted(found - listed)
    missing = [f for f in found if not (ROOT / f.replace(".", "/") / "__init__.py").is_file()]
    assert not missing, f"folders without __init__.py (a namespace package some tools skip): {missing}"


def _collected(*selections: tuple[str, ...]) -> list[int]:
    """How many tests ``pytest --collect-only`` selects with each of ``selections`` (a marker expression, paths);
    the collections run side by side (two cores: about the time of the longest)."""
    import re

    procs = [subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *a],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a in selections]
    counts = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        m = re.search(r"^(\d+)(?:/\d+)? tests? collected", out, re.M)
        assert p.returncode == 0 and m, out[-2000:] + err[-2000:]
        counts.append(int(m.group(1)))
    return counts


def test_the_test_counts_the_docs_quote_are_what_pytest_collects():
    """docs/reliability.md quotes how many tests each CPU stage of ``.ci/run`` runs, the cases of the "Bad inputs
    and faults tried" table and the security tests: each must equal what pytest collects now (collected counts,
    which a test can know; pass counts are a run's, printed by that run)."""
    import re

    text = (ROOT / "docs" / "reliability.md").read_text()
    figures = text.split("## Figures", 1)[1]
    stages = dict(re.findall(r'`pytest -m "([^"]+)"`\s+collects\s+\*\*(\d+)\*\*', figures))
    assert set(stages) == {"not slow", "slow and not vllm"}, stages
    security = re.search(r"test_security\.py`[^|]*\| \*\*(\d+)\*\* tests", figures)
    assert security, "the figures table must quote the security tests' count"
    quoted = {**stages, "security": security.group(1)}
    got = dict(zip(quoted, _collected(*[("-m", e, "tests") for e in stages], ("tests/integration/test_security.py",))))
    assert got == {k: int(v) for k, v in quoted.items()}, (got, quoted)
    section = text.split("## Bad inputs and faults tried", 1)[1].split("\n## ", 1)[0]
    table = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| group")]
    tried = re.search(r"\*\*(\d+)\*\* cases in (\d+) groups", figures)
    assert tried, "the figures table must quote the tried table's total"
    assert int(tried.group(1)) == sum(int(r.strip("|").split("|")[1]) for r in table)
    assert int(tried.group(2)) == len(table)
