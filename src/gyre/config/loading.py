"""YAML files and dotted ``key=value`` overrides into a :class:`Config`; dumping and
``--help-config``."""

from __future__ import annotations

import datetime as _dt
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)
from pydantic.fields import FieldInfo

from gyre.config.base import (
    REDACTED,
    ConfigError,
)
from gyre.config.root import Config


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{'.'.join(parts[: i + 1])}' is not a section")
        node = child
    node[parts[-1]] = value


_YAML11_BOOL_WORDS = {"on", "off", "yes", "no", "y", "n"}


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's SafeLoader, except that a mapping with the same key twice is an error (plain
    PyYAML keeps the last one and silently drops the first block)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: let SafeLoader report it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first on line {first})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass


def _yaml_error_line(exc: yaml.YAMLError) -> str:
    """A YAML error as one line: what went wrong, and where (line N, column M)."""
    mark = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{what}"


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{item}' has an empty key")
    if raw.strip().lower() in _YAML11_BOOL_WORDS:
        # YAML 1.1 reads on/off/yes/no as booleans; keep the word so 'log.console=off' works
        # (pydantic still accepts these words for bool fields).
        return key, raw.strip()
    try:
        value = _yaml_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        problem = str(getattr(exc, "problem", "") or "")
        if problem.startswith("duplicate key"):  # not a plain string either: say so
            raise ConfigError(f"override '{key}': {problem}") from None
        value = raw
    if value is None:
        value = raw
    return key, value


def _describe(errors: ValidationError, tree: dict[str, Any]) -> str:
    lines = []
    for err in errors.errors():
        loc = [str(p) for p in err["loc"]]
        if not loc:  # a cross-field check (e.g. the ray section); its message names the fields
            lines.append(err["msg"].removeprefix("Value error, "))
            continue
        if loc[-1] == "[key]":  # a mapping's key, e.g. env.maze.demonstrator_mix's names
            where = ".".join(loc[:-2])
            lines.append(f"bad key {loc[-2]!r} in '{where}' ({err['msg']})")
            continue
        key = ".".join(loc)
        node: Any = tree
        for p in loc:
            if isinstance(node, list) and p.isdigit() and int(p) < len(node):
                node = node[int(p)]  # list items, e.g. reward.functions.0.fn
            else:
                node = node.get(p, "<missing>") if isinstance(node, dict) else "<missing>"
        if loc[-1] == "api_key":
            node = REDACTED  # never echo a secret
        if err["type"] == "value_error" and isinstance(node, dict):
            # a section's cross-field check: its message names the keys and values
            lines.append(err["msg"].removeprefix("Value error, "))
            continue
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown config key '{key}' (value {node!r})")
        else:
            lines.append(f"bad value for '{key}': {node!r} ({err['msg']})")
    return "; ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a :class:`Config` from an optional YAML file plus dotted overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            line = exc.object[: exc.start].count(b"\n") + 1
            byte = exc.object[exc.start]
            raise ConfigError(
                f"config file '{p}' line {line}: not UTF-8 text (byte 0x{byte:02x})"
            ) from None
        except OSError as exc:
            raise ConfigError(f"config file '{p}' cannot be read: {exc.strerror}") from None
        try:
            loaded = _yaml_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"config file '{p}' is not valid YAML: {_yaml_error_line(exc)}"
            ) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping at the top level")
        tree = loaded
    for item in overrides or []:
        key, value = _parse_override(item)
        _set_dotted(tree, key, value)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, tree)) from None
    _absolute_file_specs(cfg, [Path(path).resolve().parent] if path is not None else [])
    return cfg


RECIPES = Path(__file__).resolve().parents[1] / "recipes"  # shipped with the package


def recipe_path(name: str) -> Path:
    """The shipped recipe ``name`` (``gyre/recipes/<name>.yaml``); the error lists them."""
    path = RECIPES / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in RECIPES.glob("*.yaml")))
        raise ConfigError(f"no shipped recipe {name!r}; shipped: {known}")
    return path


def load_recipe(name: str = "maze", overrides: list[str] | None = None) -> Config:
    """The shipped recipe ``name`` plus overrides: ``load_recipe()`` is what ``gyre train``
    runs with no config file. (``Config()`` is the fields' own defaults, with no recipe.)"""
    return load_config(recipe_path(name), overrides)


def default_config_path(overrides: list[str]) -> Path | None:
    """The file ``gyre train`` / ``sft`` / ``verify-resume`` / ``submit`` read when given none:
    the maze recipe, unless the overrides name another env or a ``model.path`` (whose folder
    records the env it was trained on), in which case the fields' defaults (None)."""
    keys = dict(item.split("=", 1) for item in overrides if "=" in item)
    if keys.get("env.name", "maze").strip() != "maze" or keys.get("model.path", "").strip():
        return None
    return recipe_path("maze")


def _absolute_file_specs(cfg: Config, bases: list[Path]) -> None:
    """Make ``file.py:attr`` specs (env.name, env.gymnasium.renderer, reward.functions[*].fn)
    absolute: relative to the config file's folder when the file is there, else to the current
    directory."""
    from gyre.plugins import PluginError, absolute_spec

    try:
        if ":" in cfg.env.name:
            cfg.env.name = absolute_spec(cfg.env.name, "env.name", bases)
        if ":" in cfg.env.gymnasium.renderer:
            key = "env.gymnasium.renderer"
            cfg.env.gymnasium.renderer = absolute_spec(cfg.env.gymnasium.renderer, key, bases)
        for i, f in enumerate(cfg.reward.functions):
            f.fn = absolute_spec(f.fn, f"reward.functions.{i}.fn", bases)
    except PluginError as exc:
        raise ConfigError(str(exc)) from None


def resolve_run_dir(cfg: Config) -> Path:
    """Fill in ``run.dir`` when empty (runs/<env>-<timestamp>) and return it as a Path."""
    if not cfg.run.dir:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg.env.name.rpartition(":")[2])
        cfg.run.dir = str(Path("runs") / f"{name}-{stamp}")
    return Path(cfg.run.dir)


ENV_RECORD = "gyre_env.json"  # in sft/ and final/: the env (and stop) config it was trained on


def dump_config(cfg: Config) -> str:
    """The config as YAML, secrets written as '***' (see :func:`resolve_api_key`)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def iter_fields(
    model: type[BaseModel] = Config, prefix: str = ""
) -> Iterator[tuple[str, FieldInfo]]:
    """Every leaf field of the tree as (dotted key, its pydantic FieldInfo), in order."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from iter_fields(ann, key + ".")
        else:
            yield key, field


def value_at(cfg: BaseModel, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def describe_fields(cfg: Config | None = None) -> list[str]:
    """One line per leaf key: ``key = value  # description`` (``gyre --help-config``).

    ``cfg`` None: the values of ``gyre train`` with no config file (the maze recipe); a key the
    recipe sets also shows its field default."""
    recipe = load_recipe() if cfg is None else cfg
    out = []
    for key, field in iter_fields():
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump()
        value = value_at(recipe, key)
        if isinstance(value, BaseModel):
            value = value.model_dump()
        note = "" if value == default else f" (field default: {default!r})"
        out.append(f"{key} = {value!r}  # {field.description}{note}")
    return out
