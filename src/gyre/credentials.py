"""Deprecated path: API keys and secrets lives in :mod:`gyre.engines.credentials` (this alias goes in the next version)."""

from gyre.plugins import moved_module

moved_module(__name__, "gyre.engines.credentials")
