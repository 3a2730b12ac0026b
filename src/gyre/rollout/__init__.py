"""Rollout: episodes of env x engine, DAPO dynamic sampling, held-out evaluation."""
