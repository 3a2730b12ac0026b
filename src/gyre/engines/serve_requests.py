"""Deprecated path: ``gyre serve``'s request bodies lives in :mod:`gyre.serve.requests` (this alias goes in the next version)."""

from gyre.plugins import moved_module

moved_module(__name__, "gyre.serve.requests")
