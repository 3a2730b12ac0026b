"""Deprecated path of :mod:`gyre.engines.credentials` (API keys and secrets); kept one version."""

from gyre.plugins import moved_module

moved_module(__name__, "gyre.engines.credentials")
