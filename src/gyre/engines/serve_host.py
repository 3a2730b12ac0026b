"""Deprecated path: the model behind ``gyre serve`` lives in :mod:`gyre.serve.host` (this alias goes in the next version)."""

from gyre.plugins import moved_module

moved_module(__name__, "gyre.serve.host")
