"""A checkpoint resumes on another number of trainer ranks, with the state it holds.

``ray.trainer_ranks`` is placement, not the run's identity: a cluster that lost a node (or
gained one) resumes the run. One process writes a checkpoint; two FSDP2 ranks (gloo on CPU)
resume it, and the whole model and optimizer state they load, gathered, equal the checkpoint's
bitwise. The two ranks train a step and write a checkpoint; one process resumes that, and the
model and optimizer state it loads equal what the two ranks held, bitwise.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from gyre.checkpoint.resume import Checkpointer
from gyre.trainer.core import Trainer
from helpers import dp_batch, ranks_cfg, resume_ranks_rank, spawn_ranks_bounded

CPU = torch.device("cpu")


def _plain(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


def _equal_optimizer(a: dict, b: dict) -> None:
    """The same moments per parameter slot, and the same hyperparameters in each group."""
    assert len(a["param_groups"]) == len(b["param_groups"])
    for ga, gb in zip(a["param_groups"], b["param_groups"], strict=True):
        assert ga["params"] == gb["params"] and ga["lr"] == gb["lr"]
        # a sharded checkpoint's groups come back through a serialiser: betas as a list
        same = [_plain(ga[k]) == _plain(gb[k]) for k in set(ga) & set(gb)]
        assert all(same), (ga, gb)
    assert a["state"].keys() == b["state"].keys()
    for slot, moments in a["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, b["state"][slot][key]), (slot, key)


def _equal_model(got: dict, want: dict) -> None:
    """Every tensor of ``want`` is in ``got``, bitwise (a state dict also names the tied output
    head, which the safetensors file leaves out)."""
    assert set(want) <= set(got), set(want) - set(got)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.slow  # two spawned ranks and three trainers: the default suite has no room left
def test_a_checkpoint_resumes_on_another_rank_count(tmp_path, make_tiny_model, tokenizer):
    model = make_tiny_model(seed=7)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    one = ranks_cfg(tmp_path / "one", tmp_path / "m", 1)
    trainer = Trainer.build(one, tmp_path / "one", tmp_path / "m", None, CPU)
    trainer.update(1, dp_batch(model)[0])
    trainer.save(Checkpointer(one, tmp_path / "one"), 1, {}, tmp_path / "one" / "metrics.jsonl")

    spawn_ranks_bounded(resume_ranks_rank, tmp_path, model, tokenizer, timeout_s=240)
    dumps = torch.load(tmp_path / "two-ranks.pt", weights_only=False)

    # one process -> two ranks: what the ranks loaded is the checkpoint
    ckpt1 = tmp_path / "one" / "checkpoints" / "step_000001"
    loaded_model, loaded_optim = dumps["loaded"]
    _equal_model(loaded_model, load_file(str(ckpt1 / "model" / "model.safetensors")))
    _equal_optimizer(loaded_optim, torch.load(ckpt1 / "optimizer.pt"))

    # two ranks -> one process: what it loads is what the two ranks held
    ckpt2 = tmp_path / "two" / "checkpoints" / "step_000002"
    back = ranks_cfg(tmp_path / "back", tmp_path / "m", 1, f"run.resume={ckpt2}")
    plan = Checkpointer(back, tmp_path / "back").plan()  # 2 ranks then, 1 now: accepted
    assert plan.ckpt is not None and plan.state["step"] == 2
    resumed = Trainer.build(back, tmp_path / "back", plan.ckpt / "model", None, CPU)
    resumed.restore(plan.ckpt)
    held_model, held_optim = dumps["held"]
    assert any(not torch.equal(held_model[k], loaded_model[k]) for k in held_model)  # trained
    _equal_model(resumed.model.state_dict(), held_model)
    _equal_optimizer(resumed.optimizer.state_dict(), held_optim)
