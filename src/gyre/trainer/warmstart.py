"""Deprecated path of :mod:`gyre.sft` (the SFT warm start); kept one version."""

from gyre.plugins import moved_module

moved_module(__name__, "gyre.sft")
