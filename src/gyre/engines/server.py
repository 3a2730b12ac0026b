"""Deprecated path: the ``gyre serve`` server lives in :mod:`gyre.serve.server` (this alias goes in the next version)."""

from gyre.plugins import moved_module

moved_module(__name__, "gyre.serve.server")
