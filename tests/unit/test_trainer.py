"""Optimizer steps: gradient accumulation invariance, ratio-1 loss value, collate/scoring."""

from __future__ import annotations

import copy

import pytest
import torch

from gyre.algos import agg_weights
from gyre.trainer.batch import collate, token_logprobs
from gyre.trainer.sft import sft_step
from gyre.trainer.update import policy_update
from gyre.types import Trajectory
from helpers import train_cfg

CPU = torch.device("cpu")


def _synthetic(model, pad_id, *, n=6, noise=0.3, seed=0):
    """Trajectories of different lengths with masked spans and near-on-policy old logprobs."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        T = int(torch.randint(8, 25, (1,), generator=g))
        ids = [1, *torch.randint(4, 100, (T - 1,), generator=g).tolist()]
        mask = [0] * 4 + (torch.rand(T - 4, generator=g) < 0.6).long().tolist()
        mask[-1] = 1
        trajs.append(Trajectory(ids, mask, [0.0] * T, 0.0, i // 2, 0, 1, False, i))
    batch = collate(trajs, pad_id, CPU)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    old = (logp + noise * torch.randn(logp.shape, generator=g)) * batch.loss_mask
    for i, t in enumerate(trajs):
        t.rollout_logprobs = old[i, : len(t.token_ids)].tolist()
    return trajs


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_collate_pads_right(tokenizer):
    a = Trajectory([1, 5, 6], [0, 1, 1], [0.0, -0.5, -0.25], 1.0, 0, 0, 1, True, 0)
    b = Trajectory([1, 7], [0, 1], [0.0, -1.0], 0.0, 0, 0, 1, False, 0)
    batch = collate([a, b], tokenizer.pad_token_id, CPU)
    pad = tokenizer.pad_token_id
    assert batch.input_ids.tolist() == [[1, 5, 6], [1, 7, pad]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert batch.rollout_logprobs.tolist() == [[0.0, -0.5, -0.25], [0.0, -1.0, 0.0]]
    assert batch.num_tokens == 3
    sub = batch.rows(slice(1, 2))
    assert sub.input_ids.tolist() == [[1, 7]]  # shared padding trimmed
    bad = Trajectory([1, 2], [0], [0.0, 0.0], 0.0, 0, 0, 1, False, 0)
    with pytest.raises(ValueError):
        collate([bad], pad, CPU)


def test_token_logprobs_alignment(make_tiny_model, tokenizer):
    """logprob[t] scores token t given tokens < t; right padding does not change it."""
    model = make_tiny_model(seed=1, sharp=True)
    long = Trajectory([1, 20, 21, 22, 23], [0, 1, 1, 1, 1], [0.0] * 5, 0.0, 0, 0, 1, False, 0)
    short = Trajectory([1, 30, 31], [0, 1, 1], [0.0] * 3, 0.0, 0, 0, 1, False, 0)
    batch = collate([long, short], tokenizer.pad_token_id, CPU)
    with torch.no_grad():
        lp, ent = token_logprobs(model, batch, entropy="metric")
        alone = torch.log_softmax(model(input_ids=torch.tensor([[1, 30, 31]])).logits, -1)
    assert lp.shape == (2, 5) and lp[0, 0] == 0.0 and lp[1, 0] == 0.0
    torch.testing.assert_close(lp[1, 1], alone[0, 0, 30])
    torch.testing.assert_close(lp[1, 2], alone[0, 1, 31])
    assert ent is not None and torch.all(ent[:, 1:][batch.attention_mask[:, 1:].bool()] > 0)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mini_batches", [1, 2])
def test_grad_accumulation_invariance(make_tiny_model, tokenizer, mini_batches, loss_agg):
    base = make_tiny_model(seed=0, sharp=True)
    trajs = _synthetic(base, tokenizer.pad_token_id)
    adv = torch.tensor([1.5, -0.5, -0.5, -0.5, 1.0, -1.0])
    start = _params(base)
    results = []
    for micro in (64, 2, 1):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        settings = train_cfg(
            clip_eps=0.2,
            mini_batches=mini_batches,
            micro_batch_size=micro,
            max_grad_norm=1e9,
            loss_agg=loss_agg,
            old_logprobs="rollout",
        )
        batch = collate(trajs, tokenizer.pad_token_id, CPU)
        metrics = policy_update(
            model, opt, batch, adv, settings, generator=torch.Generator().manual_seed(7)
        )
        results.append((_params(model), metrics))
    (ref, ref_m), others = results[0], results[1:]
    # the update is large next to the tolerance below, so a normalisation slip would show
    assert max((a - b).abs().max().item() for a, b in zip(ref, start, strict=True)) > 1e-2
    assert ref_m["train/clipfrac"] > 0  # the clip branch is exercised
    for params, m in others:
        for a, b in zip(ref, params, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        for key in ("train/loss", "train/clipfrac", "train/entropy", "train/tokens"):
            assert m[key] == pytest.approx(ref_m[key], rel=1e-4, abs=1e-6)


def test_grad_accumulation_with_adamw(make_tiny_model, tokenizer):
    base = make_tiny_model(seed=3, sharp=True)
    trajs = _synthetic(base, tokenizer.pad_token_id, seed=3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    out = []
    for micro in (64, 2):
        torch.manual_seed(0)
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = collate(trajs, tokenizer.pad_token_id, CPU)
        settings = train_cfg(
            micro_batch_size=micro, mini_batches=1, loss_agg="token-mean", old_logprobs="rollout"
        )
        policy_update(model, opt, batch, adv, settings)
        policy_update(model, opt, batch, adv, settings)
        out.append(_params(model))
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_on_policy_loss_is_minus_token_mean_advantage(make_tiny_model, tokenizer):
    """Ratio 1 everywhere: the logged loss is -sum_i(A_i * n_i) / sum_i(n_i), no clipping."""
    base = make_tiny_model(seed=4, sharp=True)
    trajs = _synthetic(base, tokenizer.pad_token_id, noise=0.0, seed=4)
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -1.0])
    n = torch.tensor([float(sum(t.loss_mask)) for t in trajs])
    expected = -(adv * n).sum() / n.sum()
    model = copy.deepcopy(base)
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    settings = train_cfg(
        micro_batch_size=4,
        kl_coef=0.1,
        mini_batches=1,
        loss_agg="token-mean",
        old_logprobs="rollout",
    )
    m = policy_update(
        model, opt, collate(trajs, tokenizer.pad_token_id, CPU), adv, settings, ref_model=ref
    )
    assert m["train/loss"] == pytest.approx(float(expected), abs=1e-4)
    assert m["train/clipfrac"] == 0.0
    assert m["train/logprob_gap"] < 1e-5
    assert m["train/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference
    assert m["train/tokens"] == float(n.sum())
    assert m["train/grad_norm"] > 0


def test_sft_step_accumulation_invariance(make_tiny_model, tokenizer):
    base = make_tiny_model(seed=5)
    trajs = _synthetic(base, tokenizer.pad_token_id, seed=5)
    out = []
    for micro in (64, 2):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        m = sft_step(model, opt, collate(trajs, tokenizer.pad_token_id, CPU), micro, 1e9)
        out.append((_params(model), m))
    for a, b in zip(out[0][0], out[1][0], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert out[0][1]["sft/loss"] == pytest.approx(out[1][1]["sft/loss"], rel=1e-5)
    # an untrained model's loss is about ln(vocab)
    assert out[0][1]["sft/loss"] == pytest.approx(torch.log(torch.tensor(100.0)).item(), abs=0.3)


def test_agg_weights_hand_values():
    mask = torch.tensor([[0.0, 1, 1, 1, 1], [0.0, 1, 1, 0, 0]])
    tm = agg_weights(mask, "token-mean")
    torch.testing.assert_close(tm, mask / 6)
    sm = agg_weights(mask, "seq-mean-token-mean")
    # row 0: 4 tokens -> 1/(4*2) each; row 1: 2 tokens -> 1/(2*2) each; each row sums to 1/2
    torch.testing.assert_close(sm[0], torch.tensor([0.0, 0.125, 0.125, 0.125, 0.125]))
    torch.testing.assert_close(sm[1], torch.tensor([0.0, 0.25, 0.25, 0.0, 0.0]))
    assert sm.sum().item() == pytest.approx(1.0) and tm.sum().item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        agg_weights(mask, "token-sum")
