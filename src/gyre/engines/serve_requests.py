"""Deprecated path of :mod:`gyre.serve.requests` (serve request bodies); kept one version."""

from gyre.plugins import moved_module

moved_module(__name__, "gyre.serve.requests")
