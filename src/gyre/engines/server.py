"""Deprecated path of :mod:`gyre.serve.server` (the ``gyre serve`` server); kept one version."""

from gyre.plugins import moved_module

moved_module(__name__, "gyre.serve.server")
