"""Data-parallel ranks with unequal shares of rows keep their collectives in step.

Two gloo ranks: rank 0 gets 5 rows, rank 1 gets 3, so rank 0 has more micro-batches (and, with
``algo.mini_batch_size``, more optimizer steps). Without the lockstep padding the rank that
finishes first waits in a collective the other never joins (FSDP2: every forward and backward;
DDP: the once-per-step counts and gradient sum), and the ranks hang until the bound below kills
them. With it, the weights equal one process doing the same optimizer steps on the union of the
ranks' rows, within fp32 tolerance.
"""

from __future__ import annotations

import torch

from gyre.models.build import load_pretrained
from gyre.trainer.batch import collate
from gyre.trainer.update import policy_update, prepare_batch
from helpers import LOCKSTEP_CASES, dp_batch, lockstep_rank, spawn_ranks_bounded, train_cfg


def _global_steps(overrides: dict) -> list[list[int]]:
    """The rows (global indices) of each joint optimizer step, as the two ranks cut them."""
    if "mini_batch_size" not in overrides:
        return [list(range(8))]
    size = overrides["mini_batch_size"]
    p0 = torch.randperm(5, generator=torch.Generator()).tolist()
    p1 = [5 + i for i in torch.randperm(3, generator=torch.Generator()).tolist()]
    return [p0[i : i + size] + p1[i : i + size] for i in range(0, 5, size)]


def test_ranks_with_unequal_rows_finish_and_match_one_process(tmp_path, make_tiny_model, tokenizer):
    model = make_tiny_model(seed=5)
    spawn_ranks_bounded(lockstep_rank, tmp_path, model, tokenizer, timeout_s=150)
    ranks = [torch.load(tmp_path / f"lockstep-{r}.pt") for r in (0, 1)]
    for name, (_, overrides) in LOCKSTEP_CASES.items():
        ref, _ = load_pretrained(tmp_path / "m", torch.device("cpu"))
        before = {k: v.clone() for k, v in ref.state_dict().items()}
        trajs, adv = dp_batch(ref)
        opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        one = {**overrides, "mini_batches": 1}
        one.pop("mini_batch_size", None)
        settings = train_cfg(loss_agg="token-mean", max_grad_norm=1e9, **one)
        steps = _global_steps(overrides)
        for rows in steps:
            batch = collate([trajs[i] for i in rows], 0, torch.device("cpu"))
            prepare_batch(ref, batch, settings)
            policy_update(ref, opt, batch, adv[rows], settings)
        for r in ranks:  # both ranks ran every joint step (the shorter one padded)
            assert r[name]["metrics"]["train/optimizer_steps"] == len(steps), name
        state = ranks[0][name]["state"]
        moved = max((ref.state_dict()[k] - before[k]).abs().max().item() for k in before)
        assert moved > 1e-3, name  # the steps did something
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, atol=1e-6, rtol=1e-5, msg=f"{name} {k}")
