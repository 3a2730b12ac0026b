"""gyre's FSDP2 path (``ray.strategy: fsdp2``) on two CPU ranks over gloo == one process.

torch 2.13's ``fully_shard`` runs on CPU with gloo, so the sharded update is checked here
without a GPU: each rank holds half the parameters and half the rows; the loss weights come from
the global counts (scaled for FSDP2's averaging reduce-scatter). After two SGD steps (not Adam,
whose normalisation hides a wrong gradient scale) the gathered full weights and the losses
match a single process updating the whole batch, within fp32 tolerance, for every loss
aggregation.
"""

from __future__ import annotations

import pytest
import torch

from gyre.algos import LOSS_AGGREGATIONS
from gyre.trainer.batch import collate
from gyre.trainer.update import policy_update
from helpers import dp_batch, fsdp2_rank, spawn_two_ranks, train_cfg


def test_two_fsdp2_cpu_ranks_equal_one_process(tmp_path, make_tiny_model, tokenizer):
    model = make_tiny_model(seed=3)
    spawn_two_ranks(fsdp2_rank, tmp_path, model, tokenizer)
    from gyre.models.build import load_pretrained

    got = torch.load(tmp_path / "fsdp2.pt")
    for agg in LOSS_AGGREGATIONS:
        ref, _ = load_pretrained(tmp_path / "m", torch.device("cpu"))
        before = {k: v.clone() for k, v in ref.state_dict().items()}
        trajs, adv = dp_batch(ref)
        opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        settings = train_cfg(
            micro_batch_size=4,
            loss_agg=agg,
            max_grad_norm=1e9,
            mini_batches=1,
            old_logprobs="rollout",
        )
        losses = []
        for _ in range(2):
            batch = collate(trajs, 0, torch.device("cpu"))
            losses.append(policy_update(ref, opt, batch, adv, settings)["train/loss"])
        state = got[agg]["state"]
        moved = max((ref.state_dict()[k] - before[k]).abs().max().item() for k in before)
        assert moved > 1e-3  # the steps did something
        assert set(state) == set(ref.state_dict())
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, atol=1e-6, rtol=1e-5, msg=f"{agg} {k}")
        assert got[agg]["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
