"""Deprecated path: the agent-proxy recorder lives in :mod:`gyre.serve.recorder` (this alias goes in the next version)."""

from gyre.plugins import moved_module

moved_module(__name__, "gyre.serve.recorder")
