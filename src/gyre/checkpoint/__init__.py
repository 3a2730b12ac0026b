"""Checkpoints: the store (atomic writes, manifests), resume planning and the stop guard."""
