"""``engine/kinds.py``: the one table of engine kinds, in step with the config's ``Literal``, with handler classes
that resolve, and the only place a kind's name is compared."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import typing

import pytest

import torchtitan_flux
from torchtitan_flux.config import Rollout
from torchtitan_flux.engine.base import EngineHandler
from torchtitan_flux.engine.kinds import ENGINE_KINDS, engine_kind, kind_names

PACKAGE = pathlib.Path(torchtitan_flux.__file__).parent


def test_table_matches_the_config_literal():
    assert typing.get_args(typing.get_type_hints(Rollout)["engine"]) == tuple(ENGINE_KINDS)
    assert all(kind.name == name for name, kind in ENGINE_KINDS.items())
    assert Rollout.engine in ENGINE_KINDS


@pytest.mark.parametrize("name", list(ENGINE_KINDS))
@pytest.mark.parametrize("trainer_on_gpu", [False, True])
def test_handlers_resolve_to_concrete_engine_handlers(name, trainer_on_gpu):
    kind = engine_kind(name)
    cls = kind.handler_class(trainer_on_gpu)
    assert issubclass(cls, EngineHandler) and not getattr(cls, "__abstractmethods__", None), cls
    if kind.borrowable_cores:  # TrainerThreads reads idle() (and the threads the constructor sets)
        assert callable(getattr(cls, "idle", None)), cls


def test_kind_properties():
    embedded, vllm, sglang = (ENGINE_KINDS[n] for n in ("embedded", "vllm", "sglang"))
    assert embedded.handler_class(True).__name__ == "EmbeddedEngine"
    assert vllm.handler_class(False).__name__ == "VllmEngine" and vllm.handler_class(True).__name__ == "VllmNcclEngine"
    assert embedded.local(launch=False) and vllm.local(launch=True)
    assert not vllm.local(launch=False) and not sglang.local(launch=True)  # sglang cannot be launched
    assert kind_names(lambda k: k.server) == "'vllm' | 'sglang'"


def test_unknown_kind_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"rollout.engine = 'vlm' is not an engine kind; allowed: 'embedded' \| "
                                         r"'vllm' \| 'sglang'"):
        engine_kind("vlm")


def test_handler_without_a_required_method_cannot_be_built():
    class NoAlive(EngineHandler):
        def start(self): ...
        def submit(self, request): ...
        def join_weight_group(self, info): ...
        def begin_update(self, version): ...
        def finish_update(self, version): ...
        def close(self): ...
        def kill(self, why): ...

    with pytest.raises(TypeError, match="alive"):
        NoAlive()


def test_table_and_early_entry_point_import_no_torch():
    """The entry point reads the table before the fork server has imported torch (``_starts_embedded_engines``)."""
    code = ("import sys\nfrom torchtitan_flux.train import _starts_embedded_engines as f\n"
            "assert f([]) and not f(['--rollout.engine', 'vllm']) and not f(['--rollout.engine=sglang'])\n"
            "assert not f(['--rollout.engine', 'bogus'])\n"
            "assert 'torch' not in sys.modules and 'torchtitan' not in sys.modules, 'imported torch'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=PACKAGE.parent, env={"PYTHONPATH": str(PACKAGE.parent), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr


def _kind_literals(node: ast.AST) -> list[str]:
    """Kind names ``node`` is or holds as string constants (a tuple, list or set of them)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [n.value for n in items if isinstance(n, ast.Constant) and n.value in ENGINE_KINDS]


def test_no_engine_kind_is_compared_outside_the_table():
    """Every kind-dependent decision reads ``ENGINE_KINDS``: no ``== "vllm"``, ``in ("vllm", "sglang")`` or
    ``case "embedded"``, and no other bare kind name (config.py's ``Literal`` and its default excepted)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel == "torchtitan_flux/engine/kinds.py":
            continue
        tree = ast.parse(path.read_text(), filename=rel)
        allowed: set[int] = set()  # ids of the constants of Literal[...] subscripts and of such fields' defaults
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "Literal":
                allowed.update(id(n) for n in ast.walk(node.slice))
            if isinstance(node, ast.AnnAssign) and node.value and "Literal[" in ast.unparse(node.annotation):
                allowed.add(id(node.value))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                names = [v for operand in (node.left, *node.comparators) for v in _kind_literals(operand)]
            elif isinstance(node, ast.MatchValue):
                names = _kind_literals(node.value)
            elif isinstance(node, ast.Constant) and id(node) not in allowed:
                names = _kind_literals(node)
            else:
                continue
            found += [f"{rel}:{node.lineno}: {name!r}" for name in names]
    assert not found, ("engine kind names outside torchtitan_flux/engine/kinds.py (read an EngineKind property "
                       "instead):\n" + "\n".join(sorted(set(found))))
