"""Deprecated path of :mod:`gyre.serve.images` (images in serve requests); kept one version."""

from gyre.plugins import moved_module

moved_module(__name__, "gyre.serve.images")
