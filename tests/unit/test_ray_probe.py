"""The sync check of a Ray rollout worker's in-process engine, driven in process (no Ray): the
trainer's probe rides with the weights (``runners/probe.py``), the worker scores it after
loading and stops the run (exit 3) when its engine does not serve what it was sent."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from gyre.config import load_config
from gyre.engines.verify import SyncNotApplied
from gyre.models.build import create_tiny_checkpoint, load_tokenizer
from gyre.runners.probe import IDS_KEY, with_probe


def _worker(cfg, path):
    from gyre.runners.actors import RolloutWorker

    threads = torch.get_num_threads()
    try:
        return RolloutWorker(cfg, str(path), 0)
    finally:
        torch.set_num_threads(threads)  # the worker sets its actor's thread count


def test_a_rollout_worker_verifies_each_sync_and_catches_one_not_applied(tmp_path, tiny_cfg):
    base = create_tiny_checkpoint(tiny_cfg, tmp_path / "v0", seed=0)
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}"])
    worker = _worker(cfg, base)
    tok = load_tokenizer(base)
    dirs = [create_tiny_checkpoint(tiny_cfg, tmp_path / f"v{v}", seed=v) for v in (1, 2)]
    trained = [AutoModelForCausalLM.from_pretrained(d) for d in dirs]
    state = with_probe(cfg, trained[0].state_dict(), trained[0], tok, 1)
    assert len(state[IDS_KEY]) == cfg.engine.verify_tokens
    worker.load_weights(state, 1)  # applied: verified
    assert worker.probe.last_gap is not None and worker.probe.last_gap < 1e-4
    worker.rollout.load_weights = lambda state, version: None  # acknowledged, not applied
    with pytest.raises(SyncNotApplied, match=r"engine rollout worker 0 serves log-probs .* "
                       r"policy version 2 over the tolerance 0.05"):  # fmt: skip
        worker.load_weights(with_probe(cfg, trained[1].state_dict(), trained[1], tok, 2), 2)


def test_verify_every_bounds_the_probes_and_http_engines_send_none(tmp_path, tiny_cfg):
    base = create_tiny_checkpoint(tiny_cfg, tmp_path / "v0", seed=0)
    model, tok = AutoModelForCausalLM.from_pretrained(base), load_tokenizer(base)
    every2 = load_config(None, ["engine.verify_every=2"])
    assert IDS_KEY not in with_probe(every2, model.state_dict(), model, tok, 3)
    assert IDS_KEY in with_probe(every2, model.state_dict(), model, tok, 4)
    off = load_config(None, ["engine.verify_every=0"])
    assert IDS_KEY not in with_probe(off, model.state_dict(), model, tok, 4)


def test_a_fault_raised_in_a_ray_actor_is_its_own_one_line():
    """Ray re-raises an actor's error as a RayTaskError that is also the error's class, whose
    text is Ray's traceback: the command's line and exit code are the actor error's."""
    ray = pytest.importorskip("ray")
    from gyre.cli import _error_line

    cause = SyncNotApplied("weight sync not applied: engine rollout worker 1 serves ...")
    wrapped = ray.exceptions.RayTaskError("rollout", "Traceback ...\n  File x", cause)
    wrapped = wrapped.as_instanceof_cause()
    assert isinstance(wrapped, SyncNotApplied)
    assert _error_line(wrapped) == (
        "gyre: aborted: weight sync not applied: engine rollout worker 1 serves ...",
        3,
    )
