"""User code named in the config: ``module:attr`` import paths and ``file.py:attr`` file paths.

Used for reward functions (``reward.functions[*].fn``) and environments (``env.name``):

- ``my_pkg.envs:GuessNumber``: imported from ``sys.path``; when the top module is not found
  there, the current directory is tried too (the ``gyre`` console script does not put it on
  ``sys.path``, so a module next to where you run it needs no ``PYTHONPATH=.``);
- ``envs.py:GuessNumber`` / ``path/to/envs.py:GuessNumber``: a Python file, loaded as a module
  (its folder goes on ``sys.path`` so it can import its neighbours). ``load_config`` makes a
  relative file path absolute: relative to the config file's folder if the file is there, else
  to the current directory, so the run's ``config.yaml`` and Ray actors find the same file.

``attr`` may be dotted (``module:Class.factory``). Errors name the config field. Only the
standard library is imported here (the reward sandbox worker uses it before anything else).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ENV_REGISTRY: dict[str, Any] = {}  # gyre.envs.register fills it; here so config can check names


class PluginError(ValueError):
    """A config's import path or file path that cannot be loaded; the message names the field."""


def is_file_spec(module: str) -> bool:
    """Whether the module part of a spec is a file path (``x.py``, ``dir/x``)."""
    return module.endswith(".py") or "/" in module or os.sep in module


def split_spec(spec: str, field: str) -> tuple[str, str]:
    mod, sep, attr = spec.rpartition(":")
    if not sep or not mod.strip() or not attr.strip():
        raise PluginError(f"{field}: expected 'module:attr' or 'file.py:attr', got {spec!r}")
    return mod.strip(), attr.strip()


def absolute_spec(spec: str, field: str, bases: Sequence[Path]) -> str:
    """``spec`` with a relative file path made absolute against the first of ``bases`` that
    holds the file (then the current directory); import paths come back unchanged."""
    mod, attr = split_spec(spec, field)
    if not is_file_spec(mod) or Path(mod).is_absolute():
        return spec
    for base in [*bases, Path.cwd()]:
        cand = (Path(base) / mod).resolve()
        if cand.is_file():
            return f"{cand}:{attr}"
    where = ", ".join(str(b) for b in [*bases, Path.cwd()])
    raise PluginError(f"{field}: file {mod!r} not found (looked in {where})")


def _load_file(path: Path, field: str) -> ModuleType:
    path = path.resolve()
    if not path.is_file():
        raise PluginError(f"{field}: file '{path}' not found")
    key = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"_gyre_user_{path.stem}_{key}"
    if name in sys.modules:
        return sys.modules[name]
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"{field}: cannot load '{path}' as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        why = f"{type(exc).__name__}: {exc}"
        raise PluginError(f"{field}: importing '{path}' raised {why}") from exc
    return module


def _import(mod: str, field: str) -> ModuleType:
    try:
        return importlib.import_module(mod)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        top = mod.split(".")[0]
        if exc.name != top or cwd in sys.path or not _in_dir(Path(cwd), top):
            raise PluginError(f"{field}: cannot import module {mod!r} ({exc})") from exc
        sys.path.append(cwd)  # the console script's sys.path lacks the current directory
        try:
            return importlib.import_module(mod)
        except ImportError as exc2:
            raise PluginError(f"{field}: cannot import module {mod!r} ({exc2})") from exc2
    except ImportError as exc:
        raise PluginError(f"{field}: cannot import module {mod!r} ({exc})") from exc


def _in_dir(folder: Path, top: str) -> bool:
    return (folder / f"{top}.py").is_file() or (folder / top / "__init__.py").is_file()


def load_object(spec: str, field: str) -> Any:
    """The object ``spec`` (``module:attr`` or ``file.py:attr``) names."""
    mod, attr = split_spec(spec, field)
    module = _load_file(Path(mod), field) if is_file_spec(mod) else _import(mod, field)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{field}: module {mod!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def module_root(spec: str) -> str | None:
    """The folder to put on an actor's ``PYTHONPATH`` so it imports ``spec`` as this process
    does (None: a file path, loaded by path, or a module not found)."""
    mod = spec.rpartition(":")[0].strip()
    if not mod or is_file_spec(mod):
        return None
    top = mod.split(".")[0]
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.origin:
        return os.getcwd() if _in_dir(Path.cwd(), top) else None
    origin = Path(found.origin).parent
    return str(origin.parent if found.submodule_search_locations else origin)


def moved_module(old: str, new: str) -> None:
    """Make the deprecated module path ``old`` an alias of the module ``new``, with a
    ``DeprecationWarning``. The alias is the same module object, so every name (private ones
    too) and every monkeypatch is shared. Old paths are kept for one version."""
    warnings.warn(
        f"{old} moved to {new}; import it from there (the old path goes in the next version)",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)
