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
from gyre.runners.probe import IDS_KEY, LOGPROBS_KEY, with_probe
from helpers import fsdp2_probe_rank, spawn_two_ranks


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


def test_a_lora_worker_that_keeps_sampling_the_base_is_caught(tmp_path, tiny_cfg):
    """LoRA: the adapter alone travels; a worker that acknowledges it and keeps the base (or an
    older adapter) serves other log-probs than the trainer's peft model and stops the run."""
    from gyre.models.lora import load_policy, trainable_state

    base = create_tiny_checkpoint(tiny_cfg, tmp_path / "base", seed=0)
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "model.lora.rank=4"])
    honest, lazy = _worker(cfg, base), _worker(cfg, base)
    lazy.rollout.load_weights = lambda state, version: None  # "loaded": still the base model
    policy, tok = load_policy(cfg, tmp_path / "run", base, torch.device("cpu"))
    torch.manual_seed(1)
    for version in (1, 2):
        for name, p in policy.named_parameters():
            if "lora_B" in name:  # what training does to the adapter (it starts at B = 0)
                p.data.normal_(0.0, 0.5)
        state = with_probe(cfg, trainable_state(policy), policy, tok, version)
        assert all("lora_" in k for k in state if k not in (IDS_KEY, LOGPROBS_KEY))
        honest.load_weights(state, version)
        assert honest.probe.last_gap is not None and honest.probe.last_gap < 1e-4
        with pytest.raises(SyncNotApplied, match=rf"rollout worker 0 .* version {version} "):
            lazy.load_weights(state, version)


def test_fsdp2_ranks_send_the_probe_of_the_whole_model(tmp_path, make_tiny_model, tokenizer):
    """Under FSDP2 every rank scores the probe (a collective forward of the sharded model); the
    probe rank 0 sends equals the unsharded model's, so the workers check FSDP2 runs too."""
    model = make_tiny_model(seed=5)
    spawn_two_ranks(fsdp2_probe_rank, tmp_path, model, tokenizer)
    cfg = load_config(None, [])
    want = with_probe(cfg, {}, model, tokenizer, 1)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"probe{rank}.pt")
        assert torch.equal(got[IDS_KEY], want[IDS_KEY])
        torch.testing.assert_close(got[LOGPROBS_KEY], want[LOGPROBS_KEY], atol=1e-5, rtol=0)


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
