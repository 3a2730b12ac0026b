"""The layer rule (docs/architecture.md "Layers"): a module imports only from its own package and
from packages on lower layers; packages on one layer never import each other. Every import
counts: module level, inside functions, under ``TYPE_CHECKING``. There are no exceptions."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "gyre"

# Lowest first. A top-level module (``loop.py``) is its own unit; a package is one unit.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("types", "errors", "deadlines", "plugins", "_pytool"),  # plain data and the standard library
    ("config", "algos"),  # the typed config; pure tensor math
    ("models",),  # building and loading models
    ("checkpoint",),  # atomic files, snapshots, resume
    ("telemetry",),  # sinks, samples, report
    ("engines", "envs", "rewards", "credentials"),  # sampling, tasks, scoring
    ("rollout", "trainer"),  # episodes -> trajectories; trajectories -> an update
    ("sft",),  # the SFT warm start
    ("loop",),  # train(cfg)
    ("runners", "serve", "tinker", "commands"),  # placements, servers, one-off commands
    ("cli",),  # the gyre command
)
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _unit(module: str) -> str | None:
    """The layer unit of ``gyre.x.y`` (``x``); None for a name outside gyre or ``gyre`` itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "gyre" and len(parts) > 1 else None


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every absolute import of a gyre module in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "gyre":  # from gyre import loop
                found += [(node.lineno, f"gyre.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"line {node.lineno}: relative import; gyre imports absolutely")
    return found


def _sources() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        unit = rel.parts[0].removesuffix(".py")
        if unit != "__init__":
            out.append((unit, path))
    return out


def test_every_unit_has_a_layer():
    units = {unit for unit, _ in _sources()}
    assert units - set(RANK) == set(), "place the new module or package in LAYERS"
    assert set(RANK) - units == set(), "LAYERS names a module that is gone"


def test_no_module_imports_from_its_own_layer_or_above():
    broken = []
    for unit, path in _sources():
        for line, module in _imports(ast.parse(path.read_text(), str(path))):
            target = _unit(module)
            if target is None or target == unit:
                continue
            if RANK[target] >= RANK[unit]:
                rel = path.relative_to(SRC.parent)
                broken.append(f"{rel}:{line} imports {module} ({unit} -> {target})")
    assert broken == []


def test_the_rule_sees_a_lazy_upward_import(tmp_path):
    code = "def f():\n    from gyre.rollout.chat import ChatTemplate\n"
    assert _imports(ast.parse(code)) == [(2, "gyre.rollout.chat")]
    assert RANK["rollout"] > RANK["engines"]  # so engines/ holding it would fail the test above


MOVED = {
    "gyre.engines.server": "gyre.serve.server",
    "gyre.engines.serve_requests": "gyre.serve.requests",
    "gyre.engines.serve_host": "gyre.serve.host",
    "gyre.engines.serve_images": "gyre.serve.images",
    "gyre.engines.recorder": "gyre.serve.recorder",
    "gyre.credentials": "gyre.engines.credentials",
    "gyre.trainer.warmstart": "gyre.sft",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_keeps_its_old_path_with_a_warning(old, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert any(
        issubclass(w.category, DeprecationWarning) and MOVED[old] in str(w.message) for w in caught
    )


MOVED_NAMES = {
    ("gyre.algos", "TOKEN_LEVEL"): "ESTIMATORS",
    ("gyre.algos.advantages", "NEEDS_TURNS"): "ESTIMATORS",
    ("gyre.rollout.episodes", "demonstrate"): "gyre.rollout.demonstrate",
    ("gyre.rollout.episodes", "prompt_ids"): "gyre.rollout.transcript",
    ("gyre.trainer.update", "batch_advantages"): "gyre.trainer.advantages",
}


@pytest.mark.parametrize(("module", "name"), sorted(MOVED_NAMES))
def test_a_moved_name_keeps_its_old_path_with_a_warning(module, name):
    with pytest.warns(DeprecationWarning, match=MOVED_NAMES[module, name]):
        value = getattr(importlib.import_module(module), name)
    assert value is not None
    with pytest.raises(AttributeError):
        importlib.import_module(module).no_such_name  # noqa: B018
