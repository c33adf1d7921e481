"""Generate docs/configuration.md: everything of ``GRPOTrainer.Config`` a TOML can set. First our sections, from the
field docstrings of torchtitan_flux/config.py, each followed by the field's declared range ("Allowed: ...",
torchtitan_flux/ranges.py), when it has one; a class whose fields are grouped by comment lines ``# -- Title: one-line
description`` (each right above its group's first field, as in ``Rollout``) gets a ``### Title`` sub-heading, the
description and a table per group. Then torchtitan 0.3.0's sections as ``run/config_file.py`` sets them (a table
each, the field docstrings read from the classes' source), and the keys of torchtitan 0.2.2's layout it translates.

    python scripts/gen_config_docs.py            # rewrite docs/configuration.md
    python scripts/gen_config_docs.py --check    # exit 1 if it is out of date (CI runs this in the tests)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import os
import re
import sys
import types
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "torchtitan_flux", "config.py")
OUT = os.path.join(ROOT, "docs", "configuration.md")


def field_docs(text: str | None = None) -> dict[str, dict[str, str]]:
    """class qualified name -> field -> docstring (the string literal right after the field's annotation), for every
    class of the source ``text`` (default: config.py's), nested ones too."""
    docs: dict[str, dict[str, str]] = {}

    def visit(body: list, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                d = docs.setdefault(prefix + node.name, {})
                for a, b in zip(node.body, node.body[1:]):
                    if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                        d[a.target.id] = " ".join(str(b.value.value).split())
                visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse(text or open(SRC).read()).body, "")
    return docs


@functools.cache
def _module_docs(module: str) -> dict[str, dict[str, str]]:
    return field_docs(inspect.getsource(sys.modules[module]))


def _doc(cls: type, name: str) -> str:
    """The docstring of field ``name`` of dataclass ``cls``, from the first class of its MRO whose source has one."""
    for klass in cls.__mro__:
        if klass.__module__ in sys.modules and klass.__module__ != "builtins":
            doc = _module_docs(klass.__module__).get(klass.__qualname__, {}).get(name)
            if doc:
                return doc
    return ""


GROUP_MARK = re.compile(r"^\s*# -- (?P<title>[^:]+): (?P<description>.+?)\s*$")


def field_groups() -> dict[str, list[tuple[str, str, list[str]]]]:
    """class name -> [(title, description, fields)], in source order, for each class with ``# -- Title:
    description`` lines among its fields; a field belongs to the group of the last such line above it (a field above
    the first one belongs to none). Classes without such lines are left out."""
    text = open(SRC).read()
    lines = text.splitlines()
    groups: dict[str, list[tuple[str, str, list[str]]]] = {}
    for node in ast.parse(text).body:
        if not isinstance(node, ast.ClassDef):
            continue
        found: list[tuple[str, str, list[str]]] = []
        prev_end = node.lineno
        for stmt in node.body:
            for line in lines[prev_end:stmt.lineno - 1]:  # the lines between two statements: comments, blanks
                m = GROUP_MARK.match(line)
                if m:
                    found.append((m["title"], m["description"], []))
            if isinstance(stmt, ast.AnnAssign) and found:
                found[-1][2].append(stmt.target.id)
            prev_end = stmt.end_lineno
        if found:
            groups[node.name] = found
    return groups


def _type(tp) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " \\| ".join(f'`"{a}"`' for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (list, tuple, dict):
        return f"{typing.get_origin(tp).__name__}[{', '.join(_type(a) for a in typing.get_args(tp))}]"
    return "Any" if tp is typing.Any else "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _default(v) -> str:
    return _cell(f"`{str(v).lower() if isinstance(v, bool) else repr(v)}`")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _holds_config_class(tp) -> bool:
    """A field whose value is (or may be) a config class chosen in Python: not settable from a TOML."""
    options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return any(dataclasses.is_dataclass(t) for t in options)


def render() -> str:
    sys.path.insert(0, ROOT)
    from torchtitan_flux.patches import apply_patches

    apply_patches()  # torchtitan's models import triton (a stub on a CPU machine)
    from torchtitan_flux import config
    from torchtitan_flux.ranges import field_ranges
    from torchtitan_flux.run import config_file
    from torchtitan_flux.run.trainer import GRPOTrainer

    docs = field_docs()
    groups = field_groups()
    lines = [
        "# Configuration reference",
        "",
        "Generated by `scripts/gen_config_docs.py` from the field docstrings of `torchtitan_flux/config.py` and of",
        "torchtitan 0.3.0's config classes; do not edit. It lists every field of `GRPOTrainer.Config` a TOML sets:",
        "our sections, then [torchtitan 0.3.0's](#torchtitan-030s-sections), then the",
        "[keys of torchtitan 0.2.2's layout](#keys-of-torchtitan-022s-layout) that are translated.",
        "Every field can be set in the TOML (`[section] field = value`) or on the command line",
        "(`--section.field value` or `--section.field=value`; booleans take `true`/`false`, lists the comma form",
        "`a,b`, a comma inside double quotes kept: `--rollout.environment_args 'name=\"a,b\",n=1'`; `\"\"` empties a",
        "list). `training.local_batch_size` is the micro-batch size in sequences. Bad values stop the run before any",
        "engine starts, with a message naming the field and what is allowed: an unknown key, a value not of the",
        "field's type (an integer is a number, `true` is not an integer), a value out of its range.",
        "",
        "A `\"package.module:name\"` value (a task, reward function, environment, controller, step callback) is",
        "imported: a module outside this repository needs the folder that holds its package on `PYTHONPATH`",
        "(`PYTHONPATH=/path/to torchrun ... --rollout.environment my_envs.my_env:MyEnv`).",
        "",
    ]

    def table(rows: list[tuple[str, str, str, str]]) -> None:
        lines.extend(["| field | type | default | meaning |", "|---|---|---|---|"])
        lines.extend(f"| `{name}` | {tp} | {default} | {_cell(doc)} |" for name, tp, default, doc in rows)
        lines.append("")

    def section(title: str, cls, prefix: str) -> None:
        lines.extend([f"## `[{prefix}]`", "", (cls.__doc__ or "").strip(), ""])
        hints = typing.get_type_hints(cls)
        ranges = field_ranges(cls)
        by_name = {f.name: f for f in dataclasses.fields(cls)}
        defaults = cls()
        nested = []

        def rows(names: list[str]) -> list[tuple[str, str, str, str]]:
            out = []
            for name in names:
                tp = hints[name]
                if dataclasses.is_dataclass(tp):
                    nested.append((name, tp))
                    continue
                doc = docs.get(cls.__name__, {}).get(name, "")
                if name in ranges:
                    doc += f" Allowed: {ranges[name][1]}."
                out.append((name, _type(tp), _default(getattr(defaults, name)), doc))
            return out

        if cls.__name__ not in groups:
            table(rows(list(by_name)))
        else:
            grouped = [n for _, _, names in groups[cls.__name__] for n in names]
            if sorted(grouped) != sorted(by_name):
                raise SystemExit(f"{cls.__name__}: fields in no group (each needs a '# -- Title: description' line "
                                 f"above it): {sorted(set(by_name) - set(grouped))}")
            for group, description, names in groups[cls.__name__]:
                lines.extend([f"### {group}", "", description[:1].upper() + description[1:], ""])
                table(rows(names))
        for name, tp in nested:
            section(title, tp, f"{prefix}.{name}")

    for name, cls in config.SECTIONS.items():
        section(name, cls, name)
    for name, cls in config.ADDED_TO_TORCHTITAN.items():
        section(name, cls, name)
    torchtitan_sections(lines, table, GRPOTrainer.Config(), config, config_file)
    return "\n".join(lines).rstrip() + "\n"


def torchtitan_sections(lines: list[str], table, defaults, config, config_file) -> None:
    """torchtitan 0.3.0's sections of ``defaults`` (a default ``GRPOTrainer.Config``) as the front end sets them: a
    table per section (nested ones after it), less our fields (above) and fields holding a config class chosen in
    Python; then the 0.2.2 keys ``config_file`` translates."""

    def rows(obj, skip=()) -> list[tuple[str, str, str, str]]:
        hints = typing.get_type_hints(type(obj))
        return [(f.name, _type(hints[f.name]), _default(getattr(obj, f.name)), _doc(type(obj), f.name))
                for f in dataclasses.fields(obj) if f.init and not f.name.startswith("_") and f.name not in skip
                and not dataclasses.is_dataclass(getattr(obj, f.name)) and not _holds_config_class(hints[f.name])]

    def section(key: str, obj, skip=()) -> None:
        cls = type(obj)
        outer = sys.modules[cls.__module__]
        for part in cls.__qualname__.split(".")[:-1]:  # "Profiler.Config": the component's docstring
            outer = getattr(outer, part)
        summary = (inspect.getdoc(outer) or "").split("\n\n")[0] if outer is not sys.modules[cls.__module__] else ""
        about = f"`{cls.__qualname__}` (`{cls.__module__}`)" + (f": {' '.join(summary.split())}" if summary else ".")
        lines.extend([f"### `[{key}]`", "", about, ""])
        table(rows(obj, skip))
        for f in dataclasses.fields(obj):
            if dataclasses.is_dataclass(getattr(obj, f.name)) and rows(getattr(obj, f.name)):
                section(f"{key}.{f.name}", getattr(obj, f.name))

    lines.extend([
        "## torchtitan 0.3.0's sections",
        "",
        "The fields of torchtitan 0.3.0's `Trainer.Config` (and our `[optimizer]`), set as ours are. torchtitan's",
        "`--module` / `--config` flags (its registries of model and trainer configs) are not read: the model's",
        "family and shapes come from `hf_assets_path`'s config.json. A field that holds a config class chosen in",
        "Python (such as `profiler.trace_post_processor`) is not settable from a TOML, except",
        "`activation_checkpoint`, chosen by `mode` (below).",
        "",
        "### Top level",
        "",
    ])
    table(rows(defaults))
    for f in dataclasses.fields(defaults):
        obj = getattr(defaults, f.name)
        if f.name == "activation_checkpoint":
            modes = " \\| ".join(f'`"{m}"`' for m in config_file.AC_MODES)
            default = next(m for m, c in config_file.AC_MODES.items() if c and isinstance(obj, c))
            lines.extend([f"### `[{f.name}]`", "", f"`mode` ({modes}, default `\"{default}\"`) picks the class: "
                          + "; ".join(f"`\"{m}\"`: {f'`{c.__qualname__}`' if c else 'no activation checkpointing'}"
                                      for m, c in config_file.AC_MODES.items())
                          + f". The fields of the default, `{type(obj).__qualname__}` (set `mode` first):", ""])
            table(rows(obj))
        elif dataclasses.is_dataclass(obj) and f.name not in config.SECTIONS and rows(obj):
            added = config.ADDED_TO_TORCHTITAN.get(f.name)
            section(f.name, obj, {a.name for a in dataclasses.fields(added)} if added else ())
            if added:
                lines.extend([f"Ours in `[{f.name}]`: see [above](#{f.name}).", ""])
    legacy = [(f"`{old}`", f"`{new}` (top level)") for old, new in config_file.LEGACY.items()]
    legacy.append(("`profiling.<field>`", "`profiler.<field>`"))
    legacy += [(f"`{key}`", "any value; nothing to set (it labels the file)" if value is None else
                f"only `{value!r}`; nothing to set (the model is read from `hf_assets_path`'s config.json)")
               for key, value in config_file.FIXED.items()]
    legacy.append(("`activation_checkpoint.mode`", "the class of `[activation_checkpoint]` (above)"))
    lines.extend(["## Keys of torchtitan 0.2.2's layout", "",
                  "Keys a torchtitan 0.2.2 TOML wrote that 0.3.0 moved or dropped; the front end translates them.", "",
                  "| key | in torchtitan 0.3.0 |", "|---|---|", *(f"| {a} | {b} |" for a, b in legacy), ""])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    text = render()
    if args.check:
        current = open(OUT).read() if os.path.exists(OUT) else ""
        if current != text:
            print(f"{OUT} is out of date: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    with open(OUT, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
