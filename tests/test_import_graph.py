"""The module graph of ``kvserve/`` has no cycles. Every import counts: module level, inside
functions and under ``TYPE_CHECKING`` (a cycle there still couples the two modules), and an import
of a package counts as an edge to its ``__init__``."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_graph(root: Path, package: str = "kvserve") -> dict[str, set[str]]:
    """``module -> modules of the package it imports`` for every ``.py`` file under ``root/package``."""
    files = {}
    for f in (root / package).rglob("*.py"):
        parts = f.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, f in files.items():
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join(here + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                # `import a.b.c` also imports a and a.b
                pieces = name.split(".")
                for i in range(1, len(pieces) + 1):
                    target = ".".join(pieces[:i])
                    if target in graph and target != mod:
                        graph[mod].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per back edge of a depth-first walk (empty iff the graph is acyclic)."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        state[u] = 2
        stack.pop()

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def import_cycles(root: Path) -> list[list[str]]:
    """The cycles of ``module_graph(root)``, leaving out edges from a module up to one of its own
    packages (``from kvserve.engine.x import y`` runs ``kvserve/__init__`` and
    ``kvserve/engine/__init__``: Python's package shape, not a coupling of two concepts)."""
    graph = module_graph(root)
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    return find_cycles(graph)


def test_kvserve_has_no_import_cycles():
    assert len(module_graph(ROOT)) > 50
    cycles = import_cycles(ROOT)
    assert not cycles, "import cycles: " + " | ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle(tmp_path):
    """The checker itself: a -> b -> (function-level) a, and a TYPE_CHECKING-only c -> a -> c."""
    pkg = tmp_path / "kvserve"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kvserve.sub import b\nfrom . import c\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvserve.a\n")
    cycles = import_cycles(tmp_path)
    assert sorted(tuple(c) for c in cycles) == [("kvserve.a", "kvserve.c", "kvserve.a"),
                                                ("kvserve.a", "kvserve.sub.b", "kvserve.a")]


def test_engine_cli_flags_are_engine_args_fields():
    """``arg_utils`` (torch-free) names every ``EngineArgs`` field once, and the parser defaults
    equal the dataclass defaults."""
    import argparse

    from kvserve.arg_utils import ENGINE_ARG_NAMES, add_engine_args, engine_kwargs
    from kvserve.config import EngineArgs

    assert list(ENGINE_ARG_NAMES) == [f.name for f in fields(EngineArgs)]
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([])) == {f.name: f.default for f in fields(EngineArgs)}
