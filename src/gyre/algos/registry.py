"""Name -> function lookups shared by the algorithm registries."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def lookup(registry: Mapping[str, T], name: str, what: str) -> T:
    """``registry[name]``, or a ValueError that names ``what`` and lists the valid names."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(sorted(registry))}") from None
