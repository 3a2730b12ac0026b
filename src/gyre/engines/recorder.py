"""Deprecated path of :mod:`gyre.serve.recorder` (the agent-proxy recorder); kept one version."""

from gyre.plugins import moved_module

moved_module(__name__, "gyre.serve.recorder")
