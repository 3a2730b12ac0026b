"""Deprecated path: images in ``gyre serve`` requests lives in :mod:`gyre.serve.images` (this alias goes in the next version)."""

from gyre.plugins import moved_module

moved_module(__name__, "gyre.serve.images")
