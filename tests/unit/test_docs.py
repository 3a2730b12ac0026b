"""docs/architecture.md and CONTRIBUTING.md name only code that exists.

Checked: every ``src/gyre/...`` path; every dotted ``gyre.<module>[.<attr>...]`` reference
(the longest importable module prefix, then ``getattr`` for the rest); every backticked
``Class.attr`` of a gyre class; the methods listed in the interface code blocks; and the package
map, which must list every subpackage and top-level module with files that exist.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from repo_files import tracked_text_files

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "gyre"
DOCS = [ROOT / "docs" / "architecture.md", ROOT / "CONTRIBUTING.md"]

PATH_RE = re.compile(r"(?<![\w/.])(?:src/)?gyre/[\w/]*\w(?:\.py)?")
DOTTED_RE = re.compile(r"(?<![\w./-])gyre(?:\.\w+)+(?::\w+)?")
CLASS_ATTR_RE = re.compile(r"`([A-Z]\w+)\.(\w+)")
BLOCK_RE = re.compile(r"```python\n(.*?)```", re.S)
CALLED_RE = re.compile(r"(?:^|[\s;/.])([a-z_]\w*)\(", re.M)
FIELD_RE = re.compile(r"^(\w+): ", re.M)


def _text(doc: Path) -> str:
    return doc.read_text(encoding="utf-8")


def missing_paths(text: str) -> list[str]:
    bad = []
    for ref in sorted(set(PATH_RE.findall(text))):
        rel = ref.removeprefix("src/")
        if not (ROOT / "src" / rel).exists():
            bad.append(ref)
    return bad


def resolve(ref: str) -> Any:
    """The object a dotted ``gyre.a.b[:c]`` reference names; raises if any part is missing."""
    dotted, _, attr = ref.partition(":")
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:  # a parent is a module, not a package
            spec = None
        if spec is None:
            continue
        obj: Any = importlib.import_module(name)
        for part in [*parts[i:], *([attr] if attr else [])]:
            obj = getattr(obj, part)  # AttributeError: the doc names something that is gone
        return obj
    raise ModuleNotFoundError(ref)


def missing_dotted(text: str) -> list[str]:
    bad = []
    for ref in sorted(set(DOTTED_RE.findall(text))):
        try:
            resolve(ref)
        except (ImportError, AttributeError):
            bad.append(ref)
    return bad


def gyre_classes() -> dict[str, list[str]]:
    """Class name -> the modules (dotted) that define it, from the source tree."""
    out: dict[str, list[str]] = {}
    for p in sorted(SRC.rglob("*.py")):
        mod = ".".join(("gyre", *p.relative_to(SRC).with_suffix("").parts))
        mod = mod.removesuffix(".__init__")
        for node in ast.parse(p.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(mod)
    return out


def has_member(cls: Any, name: str) -> bool:
    """An attribute, a pydantic field or an annotation-only member (a Protocol's ``stale_ok``)."""
    if hasattr(cls, name) or name in getattr(cls, "model_fields", {}):
        return True
    return any(name in getattr(k, "__annotations__", {}) for k in getattr(cls, "__mro__", ()))


def missing_class_attrs(text: str, classes: dict[str, list[str]]) -> list[str]:
    bad = []
    for cls, attr in sorted(set(CLASS_ATTR_RE.findall(text))):
        if cls not in classes:
            continue  # not a gyre class (e.g. a torch or Ray name)
        owners = [getattr(importlib.import_module(m), cls) for m in classes[cls]]
        if not any(has_member(c, attr) for c in owners):
            bad.append(f"{cls}.{attr}")
    return bad


def interface_blocks(text: str) -> list[tuple[str, str]]:
    """(the last backticked ``gyre.`` reference before a python block, the block)."""
    out = []
    for m in BLOCK_RE.finditer(text):
        before = re.findall(r"`(gyre(?:\.\w+)+)`", text[: m.start()])
        if before:
            out.append((before[-1], m.group(1)))
    return out


def missing_interface_names(text: str) -> list[str]:
    bad = []
    for ref, block in interface_blocks(text):
        cls = resolve(ref)
        names = set(CALLED_RE.findall(block)) | set(FIELD_RE.findall(block))
        bad += [f"{ref}.{n}" for n in sorted(names) if not has_member(cls, n)]
    return bad


def package_map(text: str) -> dict[str, str]:
    """Entry (``rollout/``, ``loop.py``) -> its text, from the code block under ``src/gyre/``."""
    block = text.split("```\nsrc/gyre/\n", 1)[1].split("```", 1)[0]
    entries: dict[str, str] = {}
    key = ""
    for line in block.splitlines():
        m = re.match(r"  (\w+(?:/|\.py))\s", line)
        if m:
            key = m.group(1)
            entries[key] = line[m.end() :]
        elif key:
            entries[key] += " " + line.strip()
    return entries


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_paths_exist(doc: Path) -> None:
    assert missing_paths(_text(doc)) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_dotted_references_resolve(doc: Path) -> None:
    assert missing_dotted(_text(doc)) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_class_attributes_exist(doc: Path) -> None:
    assert missing_class_attrs(_text(doc), gyre_classes()) == []


def test_interface_blocks_name_real_methods_and_the_whole_placement() -> None:
    text = _text(DOCS[0])
    assert missing_interface_names(text) == []
    refs = [ref for ref, _ in interface_blocks(text)]
    assert {"gyre.trainer.core.Trainer", "gyre.rollout.core.Rollout", "gyre.loop.Placement"} <= (
        set(refs)
    )
    from gyre.loop import Placement

    block = next(b for ref, b in interface_blocks(text) if ref == "gyre.loop.Placement")
    listed = set(CALLED_RE.findall(block)) | set(FIELD_RE.findall(block))
    protocol = {n for n in vars(Placement) if not n.startswith("_")}
    protocol |= set(Placement.__annotations__)
    assert protocol - listed == set(), "the doc's Placement block misses protocol members"


def test_package_map_is_complete_and_true() -> None:
    entries = package_map(_text(DOCS[0]))
    subpackages = {f"{p.name}/" for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.name for p in SRC.glob("*.py") if p.name != "__init__.py"}
    assert set(entries) == subpackages | modules
    for key, desc in entries.items():
        if key.endswith("/"):
            for f in re.findall(r"\b(\w+\.py)\b", desc):
                assert (SRC / key / f).is_file(), f"package map: {key}{f} does not exist"


def test_checks_catch_bogus_references() -> None:
    """The checks above can fail: each rejects a reference to something that does not exist."""
    bogus = "see `src/gyre/nowhere.py`, `gyre.loop.no_such_fn`, `gyre.no_such_pkg.mod`"
    assert missing_paths(bogus) == ["src/gyre/nowhere.py"]
    assert missing_dotted(bogus) == ["gyre.loop.no_such_fn", "gyre.no_such_pkg.mod"]
    assert missing_dotted("`gyre.rewards.math_answer:no_such`") == [
        "gyre.rewards.math_answer:no_such"
    ]
    assert missing_class_attrs("`Trainer.no_such_method`", gyre_classes()) == [
        "Trainer.no_such_method"
    ]
    block = "`gyre.trainer.core.Trainer`\n```python\ntrainer.no_such(step)\n```\n"
    assert missing_interface_names(block) == ["gyre.trainer.core.Trainer.no_such"]
    assert missing_paths("`src/gyre/loop.py`") == [] and missing_dotted("`gyre.loop.train`") == []


# "=======" alone is also a Markdown heading underline, so only the two outer markers count.
CONFLICT_RE = re.compile(r"^(<{7}|>{7}) ", re.M)


def conflict_markers(text: str) -> list[str]:
    return [m.group(0).strip() for m in CONFLICT_RE.finditer(text)]


def test_no_merge_conflict_markers_anywhere() -> None:
    bad = [
        str(p.relative_to(ROOT))
        for p in tracked_text_files()
        if conflict_markers(p.read_text(encoding="utf-8"))
    ]
    assert bad == [], f"unresolved merge conflict markers in {bad}"


def test_conflict_check_can_fail() -> None:
    marked = "a\n" + "<" * 7 + " HEAD\nb\n" + "=" * 7 + "\nc\n" + ">" * 7 + " other\n"
    assert conflict_markers(marked) == ["<" * 7, ">" * 7]
    assert conflict_markers("a heading\n=======\n") == []
