"""The documentation site: it builds with ``mkdocs build --strict`` (broken links fail), its
generated reference pages are up to date, every code block of the getting-started page and the
how-to guides runs, and no file of the repository cites a numbered work diary.

Code blocks: a ``bash`` or ``python`` block must be preceded by ``<!-- test: fast -->`` (run in
the default suite, as written) or ``<!-- test: slow -->`` (run with ``GYRE_SLOW=1``). A page's
blocks run in order in one scratch directory that links ``examples/`` and ``scripts/``, with
``gyre`` on the PATH. ``yaml`` blocks are validated as gyre configs. ``text`` blocks (commands
that need a cluster or the network, output) are not run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from repo_files import tracked_text_files

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RUN_PAGES = [DOCS / "getting-started.md", *sorted((DOCS / "howto").glob("*.md"))]
BLOCK_RE = re.compile(r"(?:<!-- test: (\w+) -->\n)?```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def code_blocks(text: str) -> list[tuple[str, str, str]]:
    """(marker or '', language, body) of every fenced block, in order."""
    return [(m.group(1) or "", m.group(2), m.group(3)) for m in BLOCK_RE.finditer(text)]


def _gen_reference():
    spec = importlib.util.spec_from_file_location(
        "gen_reference", ROOT / "scripts" / "gen_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
    pytest.importorskip("material", reason="mkdocs-material is not installed (the docs extra)")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (the docs extra)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_generated_reference_pages_are_up_to_date() -> None:
    gen = _gen_reference()
    for name, text in gen.pages().items():
        path = gen.PAGES[name]
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.relative_to(ROOT)} is out of date: run python scripts/gen_reference.py"
        )


def test_config_reference_lists_every_key() -> None:
    from gyre.config.loading import iter_fields

    text = (DOCS / "reference" / "config.md").read_text(encoding="utf-8")
    for key, _ in iter_fields():
        assert f"| `{key}` |" in text, key


def _scratch(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    for name in ("examples", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return tmp_path, env


def _run_page(page: Path, tmp_path: Path, slow: bool) -> int:
    from gyre.config import Config

    work, env = _scratch(tmp_path)
    ran = 0
    for i, (marker, lang, body) in enumerate(code_blocks(page.read_text(encoding="utf-8"))):
        where = f"{page.name} block {i} ({lang})"
        if lang == "yaml":
            Config.model_validate(yaml.safe_load(body))  # a wrong key fails here, named
            continue
        if lang not in ("bash", "python"):
            continue
        assert marker in ("fast", "slow"), f"{where}: mark it <!-- test: fast|slow -->"
        if marker == "slow" and not slow:
            continue
        cmd = (
            ["bash", "-euo", "pipefail", "-c", body]
            if lang == "bash"
            else [sys.executable, "-c", body]
        )
        out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=3600)
        assert out.returncode == 0, (
            f"{where} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        )
        ran += 1
    return ran


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.stem)
def test_page_blocks_fast(page: Path, tmp_path: Path) -> None:
    _run_page(page, tmp_path, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.stem)
def test_page_blocks_all(page: Path, tmp_path: Path) -> None:
    _run_page(page, tmp_path, slow=True)


def test_every_run_page_has_blocks_and_unmarked_ones_fail(tmp_path: Path) -> None:
    for page in RUN_PAGES:
        langs = [lang for _, lang, _ in code_blocks(page.read_text(encoding="utf-8"))]
        assert {"bash", "python"} & set(langs), f"{page.name} has no runnable block"
    bad = tmp_path / "bad.md"
    bad.write_text("```bash\necho unmarked\n```\n")
    with pytest.raises(AssertionError, match="mark it"):
        (tmp_path / "w").mkdir()
        _run_page(bad, tmp_path / "w", slow=False)


# A numbered reference to the project's work history: the words for a work session or an
# issue followed by a number, or a fixture named after one (test_diary_check_can_fail shows
# each). Built from parts so that this file does not match itself.
DIARY_RE = re.compile(
    r"(?i)(\b" + "session" + r"s?[ _-]?\d+|_" + "session" + r"\d|\b" + "issue" + r"s? ?#?\d+\b)"
)


def diary_references(text: str) -> list[str]:
    return [m.group(0) for m in DIARY_RE.finditer(text)]


def test_no_numbered_diary_reference_anywhere() -> None:
    bad = []
    for path in tracked_text_files():
        rel = path.relative_to(ROOT)
        found = diary_references(path.read_text(encoding="utf-8"))
        bad += [f"{rel}: {hit!r}" for hit in found]
        bad += [f"{rel}: the file name" for _ in diary_references(str(rel))]
    assert bad == [], (
        "numbered work-diary references (write dates or results instead):\n" + "\n".join(bad)
    )


def test_diary_check_can_fail() -> None:
    s, i = "Session", "issue"
    assert diary_references(f"{s} 19 found it; see {i} 20 and {s.lower()}s 2-6") == [
        f"{s} 19",
        f"{i} 20",
        f"{s.lower()}s 2",
    ]
    assert diary_references(f"maze_{s.lower()}6.yaml") == [f"_{s.lower()}6"]
    assert diary_references("an HTTP session, the engine's session id, sessions of a server") == []


def test_readme_is_short_and_its_links_exist() -> None:
    """The README is a user's first page: at most 150 lines, every relative link a real file."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#\s]+)", text)
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert missing == []
