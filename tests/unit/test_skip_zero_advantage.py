"""``train.algo.skip_zero_advantage``: rows with zero advantage are left out of the update's
forward/backward and of the old-logprob recompute, and the update is the same as without it."""

from __future__ import annotations

import copy

import pytest
import torch

from gyre.algos import LOSS_AGGREGATIONS, POLICY_LOSSES
from gyre.trainer.batch import collate
from gyre.trainer.update import can_skip_rows, policy_update, prepare_batch
from gyre.types import Trajectory
from helpers import train_cfg

CPU = torch.device("cpu")


def _trajs(pad_id: int, n: int = 12, seed: int = 0) -> list[Trajectory]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = int(torch.randint(8, 25, (1,), generator=g))
        ids = [1, *torch.randint(4, 100, (T - 1,), generator=g).tolist()]
        mask = [0] * 4 + (torch.rand(T - 4, generator=g) < 0.6).long().tolist()
        mask[-1] = 1
        lp = (-torch.rand(T, generator=g) * 3).tolist()
        out.append(Trajectory(ids, mask, lp, 0.0, i // 4, 0, 1, False, i))
    return out


def _update(base, trajs, pad, settings, adv, steps: int = 1):
    """``steps`` updates of a copy of ``base`` with AdamW (state carried over), one per entry of
    ``adv``; returns the model and the last metrics."""
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    m: dict[str, float] = {}
    for a in adv[:steps]:
        batch = collate(trajs, pad, CPU)
        m.update(prepare_batch(model, batch, settings))
        m.update(policy_update(model, opt, batch, a, settings, generator=torch.Generator()))
    return model, m


def _close(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Equal up to float rounding. Skipping rows changes the batch's shape, hence the float order
    of the (lean, packed) forward; AdamW divides by sqrt(v), so a rounding-level difference in a
    near-zero gradient can move a weight by a small fraction of the learning rate (0.01 here):
    2e-4 is 2 % of one step, far below what a wrongly skipped row would change (AdamW hides a
    gradient scale error, which the grad-norm check in the test catches)."""
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y, atol=2e-4, rtol=1e-5)


def _moved(a: torch.nn.Module, b: torch.nn.Module, tol: float) -> bool:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return any(float((x - y).abs().max()) > tol for x, y in pairs)


@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("loss_agg", LOSS_AGGREGATIONS)
def test_same_update_with_and_without_skipping(make_tiny_model, tokenizer, loss_agg, loss):
    """Two mini-batches, recomputed old log-probs and rollout IS: the weights after the update,
    the loss and the gradient norm match; the zero rows were really skipped."""
    base = make_tiny_model(seed=0, sharp=True)
    pad = tokenizer.pad_token_id
    trajs = _trajs(pad)
    adv = torch.randn(len(trajs), generator=torch.Generator().manual_seed(1))
    adv[[0, 1, 2, 3, 8, 9, 10, 11]] = 0.0  # two of three groups with equal rewards
    kw = dict(
        mini_batches=2, micro_batch_size=3, loss_agg=loss_agg, policy_loss=loss,
        old_logprobs="recompute", rollout_is="truncate", max_grad_norm=1e9,
        clip_eps=0.2 if loss != "gspo" else 0.02,
    )  # fmt: skip
    full, m_full = _update(base, trajs, pad, train_cfg(**kw), [adv])
    fast, m_fast = _update(base, trajs, pad, train_cfg(**kw, skip_zero_advantage=True), [adv])
    _close(full, fast)
    assert _moved(full, base, 1e-4)
    assert m_fast["train/loss"] == pytest.approx(m_full["train/loss"], abs=1e-6)
    assert m_fast["train/grad_norm"] == pytest.approx(m_full["train/grad_norm"], rel=1e-5)
    assert m_fast["train/tokens"] == m_full["train/tokens"]
    assert m_fast["train/skipped_rows"] == 8.0
    assert "train/skipped_rows" not in m_full


def test_per_token_advantages_and_an_all_zero_step(make_tiny_model, tokenizer):
    """Per-token advantages; then a step whose every row has A = 0 still steps AdamW with a
    zero gradient (its momentum moves the weights), exactly as the unskipped update does."""
    base = make_tiny_model(seed=1, sharp=True)
    pad = tokenizer.pad_token_id
    trajs = _trajs(pad, seed=1)
    T = max(len(t.token_ids) for t in trajs)
    first = torch.randn(len(trajs), T, generator=torch.Generator().manual_seed(2))
    first[4:8] = 0.0
    kw = dict(mini_batches=1, old_logprobs="auto", max_grad_norm=1e9, loss_agg="token-mean")
    advs = [first, torch.zeros(len(trajs))]
    for steps in (1, 2):
        full, _ = _update(base, trajs, pad, train_cfg(**kw), advs, steps)
        skip = train_cfg(**kw, skip_zero_advantage=True)
        fast, m = _update(base, trajs, pad, skip, advs, steps)
        _close(full, fast)
        assert m["train/skipped_rows"] == (4.0 if steps == 1 else 12.0)
    one, _ = _update(base, trajs, pad, train_cfg(**kw), advs, 1)
    assert _moved(one, full, 1e-5)  # the all-zero step did move the weights
    # a step with every row skipped measured no token: its entropy / KL / clipfrac are absent,
    # not a false 0.0, while the unskipped update reports them
    _, m_zero = _update(base, trajs, pad, skip, advs[1:], 1)
    _, m_zero_full = _update(base, trajs, pad, train_cfg(**kw), advs[1:], 1)
    assert m_zero["train/skipped_rows"] == 12.0
    for key in ("train/entropy", "train/kl", "train/clipfrac", "train/logprob_gap"):
        assert key not in m_zero and key in m_zero_full
    assert m_zero_full["train/entropy"] > 0


def test_old_logprobs_are_recomputed_only_for_trained_rows(make_tiny_model, tokenizer):
    base = make_tiny_model(seed=2, sharp=True)
    pad = tokenizer.pad_token_id
    trajs = _trajs(pad, seed=2)
    s = train_cfg(mini_batches=2, old_logprobs="recompute", skip_zero_advantage=True)
    batch = collate(trajs, pad, CPU)
    assert prepare_batch(base, batch, s) == {} and "old_logprobs" not in batch.extras  # deferred
    rows = torch.tensor([i % 3 == 0 for i in range(len(trajs))])
    prepare_batch(base, batch, s, rows=rows)
    whole = collate(trajs, pad, CPU)
    prepare_batch(base, whole, train_cfg(mini_batches=2, old_logprobs="recompute"))
    old, ref = batch.extras["old_logprobs"], whole.extras["old_logprobs"]
    torch.testing.assert_close(old[rows], ref[rows], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(old[~rows], (batch.rollout_logprobs * batch.loss_mask)[~rows])


def test_not_applied_when_a_term_does_not_scale_with_the_advantage():
    s = train_cfg(skip_zero_advantage=True)
    assert can_skip_rows(s, False, None)
    assert not can_skip_rows(s, True, None)  # KL in the loss
    assert not can_skip_rows(train_cfg(skip_zero_advantage=True, entropy_coef=0.01), False, None)
    assert not can_skip_rows(s, False, object())  # a value model
    assert not can_skip_rows(train_cfg(), False, None)


def test_setting_on_but_not_applicable_still_recomputes_old_logprobs(make_tiny_model, tokenizer):
    """An entropy bonus turns skipping off; the deferred old-logprob recompute must still happen
    (it once fell back to the engine's log-probs), so the update equals the one without the
    setting, bit for bit (no row is skipped)."""
    base = make_tiny_model(seed=3, sharp=True)
    pad = tokenizer.pad_token_id
    trajs = _trajs(pad, seed=3)
    adv = torch.randn(len(trajs), generator=torch.Generator().manual_seed(4))
    adv[:4] = 0.0
    kw = dict(mini_batches=2, old_logprobs="recompute", entropy_coef=0.01, max_grad_norm=1e9)
    plain, m_plain = _update(base, trajs, pad, train_cfg(**kw), [adv])
    on, m_on = _update(base, trajs, pad, train_cfg(**kw, skip_zero_advantage=True), [adv])
    assert "train/skipped_rows" not in m_on
    assert m_on["train/rollout_logprob_gap"] == m_plain["train/rollout_logprob_gap"] > 0.1
    for x, y in zip(plain.parameters(), on.parameters(), strict=True):
        assert torch.equal(x, y)
