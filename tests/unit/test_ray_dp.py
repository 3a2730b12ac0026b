"""Data parallelism over gloo: two ranks on half the rows each == one process on all rows.

SGD (not Adam, whose first step hides a wrong scale) and ranks with different micro-batch sizes:
the loss weights must come from the step's *global* token / row count, and the gradients must
be summed across ranks, for the two to agree.
"""

from __future__ import annotations

import torch

from gyre.algos import LOSS_AGGREGATIONS
from gyre.trainer.batch import collate
from gyre.trainer.update import policy_update
from helpers import dp_batch, dp_rank, spawn_two_ranks, train_cfg


def test_two_gloo_ranks_equal_one_process(tmp_path, make_tiny_model, tokenizer):
    model = make_tiny_model(seed=3)
    spawn_two_ranks(dp_rank, tmp_path, model, tokenizer)
    from gyre.models.build import load_pretrained

    for agg in LOSS_AGGREGATIONS:
        dp = torch.load(tmp_path / f"dp-{agg}.pt")
        ref, _ = load_pretrained(tmp_path / "m", torch.device("cpu"))
        before = {k: v.clone() for k, v in ref.state_dict().items()}
        trajs, adv = dp_batch(ref)
        opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        settings = train_cfg(
            micro_batch_size=3,
            loss_agg=agg,
            max_grad_norm=1e9,
            mini_batches=1,
            old_logprobs="rollout",
        )
        policy_update(ref, opt, collate(trajs, 0, torch.device("cpu")), adv, settings)
        moved = max((ref.state_dict()[k] - before[k]).abs().max().item() for k in before)
        assert moved > 1e-3  # the step did something
        for k, v in ref.state_dict().items():
            assert torch.allclose(dp[k], v, atol=1e-6, rtol=1e-5), (agg, k)
