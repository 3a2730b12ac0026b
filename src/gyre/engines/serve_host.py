"""Deprecated path of :mod:`gyre.serve.host` (the model behind ``gyre serve``); kept one version."""

from gyre.plugins import moved_module

moved_module(__name__, "gyre.serve.host")
