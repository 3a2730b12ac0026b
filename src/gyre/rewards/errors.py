"""Reward errors. All are ``ValueError``s so that the CLI reports them as one clear line."""

from __future__ import annotations


class RewardError(ValueError):
    """A reward function is misconfigured or misbehaved; the message names the config field."""


class RewardSandboxError(RewardError):
    """Too many sandboxed reward calls failed in one step (``reward.sandbox.max_failure_frac``)."""


class SandboxUnavailableError(RewardError):
    """The sandbox cannot enforce what it was asked to (e.g. no network namespaces here)."""
