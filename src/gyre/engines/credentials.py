"""The HTTP engines' API key: where it comes from, and how it stays off disk and command lines.

``engine.api_key`` is a pydantic ``SecretStr`` (written as ``'***'`` by every config dump: see
:data:`gyre.config.REDACTED`); the real key is read here, when an engine is built.
"""

from __future__ import annotations

import os
from pathlib import Path

from gyre.config import REDACTED, ConfigError, EngineConfig

API_KEY_ENV = "GYRE_API_KEY"


def secrets_to_env(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """Take ``engine.api_key=...`` out of overrides handed to another process (a subprocess, a
    Ray job) and return it as ``GYRE_API_KEY``, so the key is not on that command line."""
    rest, env = [], {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.strip() == "engine.api_key":
            env[API_KEY_ENV] = value
        else:
            rest.append(item)
    return rest, env


def resolve_api_key(engine: EngineConfig) -> str:
    """The bearer token for HTTP engines: ``engine.api_key`` if given (a one-off), else the
    ``GYRE_API_KEY`` environment variable, else the first line of ``engine.api_key_file``; ''
    when none is set. A config read back from a run dir holds '***' in place of the key."""
    key = engine.api_key.get_secret_value()
    if key and key != REDACTED:
        return key
    if os.environ.get(API_KEY_ENV):
        return os.environ[API_KEY_ENV]
    if engine.api_key_file:
        try:
            lines = Path(engine.api_key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"engine.api_key_file={engine.api_key_file!r} cannot be read: {exc}"
            ) from None
        if not lines or not lines[0].strip():
            raise ConfigError(f"engine.api_key_file={engine.api_key_file!r} is empty")
        return lines[0].strip()
    if key == REDACTED:
        raise ConfigError(
            f"engine.api_key is the redacted placeholder {REDACTED!r} (a config read back from a "
            f"run dir); set {API_KEY_ENV} or engine.api_key_file"
        )
    return ""
