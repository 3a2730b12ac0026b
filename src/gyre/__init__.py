"""gyre: reinforcement-learning post-training of language models, from a laptop CPU to a cluster."""

from importlib.metadata import PackageNotFoundError, version

try:  # the installed distribution's version: pyproject.toml's, the one CHANGELOG.md names
    __version__ = version("gyre")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"
