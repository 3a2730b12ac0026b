"""Deprecated path: the SFT warm start lives in :mod:`gyre.sft` (this alias goes in the next version)."""

from gyre.plugins import moved_module

moved_module(__name__, "gyre.sft")
