"""Packed and chunked scoring equal the plain full-vocab path: logprobs, entropy, loss, grads."""

from __future__ import annotations

import copy

import pytest
import torch

from gyre.trainer.batch import collate, token_logprobs
from gyre.trainer.packing import PACK_MIN_SAVING, pack_rows
from gyre.trainer.scoring import ScoringOptions
from gyre.trainer.update import policy_update
from gyre.types import Trajectory
from helpers import train_cfg

CPU = torch.device("cpu")
PLAIN = ScoringOptions(pack=False, chunk=0)


def _trajs(n: int = 7, seed: int = 0) -> list[Trajectory]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = int(torch.randint(3, 30, (1,), generator=g))
        ids = [1, *torch.randint(4, 90, (T - 1,), generator=g).tolist()]
        mask = [0, *(torch.rand(T - 1, generator=g) < 0.6).long().tolist()]
        lps = [-(0.5 + float(torch.rand(1, generator=g))) * m for m in mask]
        out.append(Trajectory(ids, mask, lps, 0.0, i // 2, 0, 1, False, i))
    return out


def test_pack_rows_places_every_row_once():
    lengths = [5, 3, 9, 1, 4, 9]
    ids = torch.arange(6 * 9).view(6, 9)
    p = pack_rows(ids, lengths, pad_token_id=-1)
    assert p.input_ids.shape[1] == 9 and p.input_ids.shape[0] < 6
    for b, n in enumerate(lengths):
        r, o = int(p.row[b]), int(p.offset[b])
        assert torch.equal(p.input_ids[r, o : o + n], ids[b, :n])
        assert p.position_ids[r, o : o + n].tolist() == list(range(n))
    assert int((p.input_ids != -1).sum()) == sum(lengths)


@pytest.mark.parametrize(
    "opts",
    [ScoringOptions(True, 0), ScoringOptions(False, 7), ScoringOptions(True, 5)],
    ids=["packed", "chunked", "packed+chunked"],
)
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_fast_logprobs_equal_full(make_tiny_model, opts, temperature, top_p):
    model = make_tiny_model(seed=3, sharp=True)
    batch = collate(_trajs(), 0, CPU)
    lengths = batch.attention_mask.sum(1).tolist()
    saving = pack_rows(batch.input_ids, lengths, 0).num_positions / batch.input_ids.numel()
    assert saving <= PACK_MIN_SAVING, "the data must be packable, else packing is not tested"
    with torch.no_grad():
        ref, ref_ent = token_logprobs(model, batch, temperature, top_p, True, options=PLAIN)
        got, ent = token_logprobs(model, batch, temperature, top_p, True, options=opts)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[real], ref_ent[real], atol=1e-5, rtol=1e-5)
    assert torch.all(got[:, 0] == 0.0)


@pytest.mark.parametrize("micro", [64, 3])
def test_packed_chunked_update_equals_plain(make_tiny_model, micro):
    """One GRPO step: same loss and same gradients (fp32 tolerance) packed+chunked vs plain."""
    base = make_tiny_model(seed=5, sharp=True)
    trajs = _trajs(8, seed=1)
    adv = torch.linspace(-1.5, 1.5, 8)
    results = {}
    for name, scoring in (("plain", PLAIN), ("fast", ScoringOptions(pack=True, chunk=4))):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        m = policy_update(
            model,
            opt,
            collate(trajs, 0, CPU),
            adv,
            train_cfg(
                micro_batch_size=micro,
                max_grad_norm=1e9,
                mini_batches=1,
                loss_agg="token-mean",
                old_logprobs="rollout",
            ),
            scoring=scoring,
        )
        grads = [p.grad.detach().clone() for p in model.parameters()]
        results[name] = (m, grads)
    (mp, gp), (mf, gf) = results["plain"], results["fast"]
    assert mf["train/loss"] == pytest.approx(mp["train/loss"], abs=1e-6, rel=1e-5)
    assert abs(mp["train/loss"]) > 1e-3
    for a, b in zip(gp, gf, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)
    assert sum(float(g.abs().sum()) for g in gp) > 0


def test_prefix_groups_keep_each_prompt_group_whole():
    """A lone row sorted just before a group of rows sharing a 5-token prompt must not pull the
    group into a tree that shares only the first token (the greedy grouping did); two prompt
    groups sharing only their first tokens stay two trees."""
    from gyre.trainer.packing import _prefix_groups

    lone = [1, 2, 9, 9, 9, 9]
    group_a = [[1, 3, 4, 5, 6, 10 + k, 20] for k in range(8)]
    group_b = [[1, 3, 4, 7, 7, 30 + k] for k in range(8)]
    rows = [lone, *group_a, *group_b]
    groups = sorted((sorted(m), p) for m, p in _prefix_groups(rows))
    assert groups == [([0], 0), (list(range(1, 9)), 5), (list(range(9, 17)), 5)]
    # every row is in exactly one group, and the prefix really is shared
    for members, p in groups:
        assert len({tuple(rows[i][:p]) for i in members}) == 1


def test_prefix_groups_respect_the_width_cap(monkeypatch):
    import gyre.trainer.packing as sc

    monkeypatch.setattr(sc, "TREE_MAX_WIDTH", 20)
    rows = [[1, 2, 3, 4] + [5 + k] * 6 for k in range(8)]  # 8 rows of 10, prefix 4
    for members, p in sc._prefix_groups(rows):
        assert p + sum(len(rows[i]) - p for i in members) <= 20


def test_perf_defaults_are_the_previous_scoring_defaults():
    """The ``perf:`` defaults are the paths the trainer took before the section existed (packing,
    1024-position chunks, lean forward, tree packing, trimming), also via the update settings."""
    from gyre.config import load_config

    cfg = load_config()
    old = ScoringOptions(pack=True, chunk=1024, lean=True, share_prefix=True, trim=True)
    assert ScoringOptions.from_perf(cfg.perf) == old == ScoringOptions()


def _update_with(cfg_overrides: list[str], model: torch.nn.Module, trajs: list[Trajectory]):
    """One GRPO update with the settings the loop builds from a config with ``cfg_overrides``."""
    from gyre.config import load_config
    from gyre.trainer.update import policy_update

    cfg = load_config(None, ["train.mini_batches=1", *cfg_overrides])
    scoring = ScoringOptions.from_perf(cfg.perf)  # what Trainer.update passes
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    adv = torch.linspace(-1.0, 1.0, len(trajs))
    batch = collate(trajs, 0, CPU)
    return scoring, policy_update(model, opt, batch, adv, cfg.train, scoring=scoring)


def test_perf_keys_reach_the_trainer_scoring(monkeypatch, make_tiny_model):
    """perf.pack / perf.logprob_chunk / perf.train_lean_forward of the run config decide which
    path the update's scoring takes (spied on); no process-wide state is involved."""
    import gyre.models.lean as lean_mod
    import gyre.trainer.batch as batch_mod
    import gyre.trainer.scoring as sc

    calls: dict[str, int] = {"pack": 0, "fast": 0, "lean": 0}

    def spy(name, real):
        def wrapped(*a, **k):
            calls[name] += 1
            return real(*a, **k)

        return wrapped

    monkeypatch.setattr(sc, "pack_rows", spy("pack", sc.pack_rows))
    monkeypatch.setattr(
        batch_mod, "chunked_token_logprobs", spy("fast", batch_mod.chunked_token_logprobs)
    )
    monkeypatch.setattr(lean_mod.LeanForward, "hidden", spy("lean", lean_mod.LeanForward.hidden))
    model = make_tiny_model(seed=3)
    trajs = _trajs(8, seed=1)  # packable: packing saves more than 10 % of the positions
    runs = {
        "default": [],
        "no_pack": ["perf.pack=false"],
        "plain": ["perf.pack=false", "perf.logprob_chunk=0"],
        "hf": ["perf.train_lean_forward=false"],
    }
    seen = {}
    for name, overrides in runs.items():
        calls.update(pack=0, fast=0, lean=0)
        settings, _ = _update_with(overrides, copy.deepcopy(model), trajs)
        seen[name] = dict(calls)
    assert seen["default"]["pack"] > 0 and seen["default"]["lean"] > 0
    assert seen["no_pack"]["pack"] == 0 and seen["no_pack"]["fast"] > 0  # padded + chunked
    assert seen["plain"] == {"pack": 0, "fast": 0, "lean": 0}  # the plain full-logits path
    assert seen["hf"]["lean"] == 0 and seen["hf"]["pack"] > 0  # packed through the HF decoder
    assert settings.lean is False


def test_perf_share_prefix_reaches_the_trainer_scoring(monkeypatch, make_tiny_model):
    """perf.share_prefix=false: a batch of groups sharing a prompt is not tree-packed."""
    import gyre.trainer.packing as sc

    trees = []
    real = sc.tree_pack
    monkeypatch.setattr(sc, "tree_pack", lambda *a, **k: trees.append(1) or real(*a, **k))
    prompt = [1, 5, 6, 7, 8, 9, 10, 11]
    g = torch.Generator().manual_seed(4)
    trajs = []
    for i in range(8):
        answer = torch.randint(20, 60, (3,), generator=g).tolist()
        mask = [0] * 8 + [1] * 3
        lps = [-1.0 * m for m in mask]
        trajs.append(Trajectory(prompt + answer, mask, lps, 0.0, i // 4, 0, 1, False, i // 4))
    model = make_tiny_model(seed=3)
    _update_with([], copy.deepcopy(model), trajs)
    assert trees, "the default must tree-pack this batch, else the switch is not tested"
    trees.clear()
    _update_with(["perf.share_prefix=false"], copy.deepcopy(model), trajs)
    assert not trees


def _fed_positions(monkeypatch) -> list[int]:
    """Record the real (non-pad, id != 0) positions each lean forward is given."""
    import gyre.models.lean as lean_mod

    fed: list[int] = []
    real = lean_mod.LeanForward.hidden

    def hidden(self, input_ids, *a, **k):
        fed.append(int((input_ids != 0).sum()))
        return real(self, input_ids, *a, **k)

    monkeypatch.setattr(lean_mod.LeanForward, "hidden", hidden)
    return fed


@pytest.mark.parametrize(
    "opts",
    [ScoringOptions(False, 7), ScoringOptions(True, 0), ScoringOptions(True, 5)],
    ids=["padded+chunked", "packed", "packed+chunked"],
)
def test_score_mask_scores_only_what_it_needs(make_tiny_model, monkeypatch, opts):
    """With score_mask (the loss mask) the masked tokens' log-probs equal the plain path's,
    the rest read 0, and the forward sees only row b's tokens before its last masked one:
    never a row's last token, nothing after its last action, no row without one."""
    model = make_tiny_model(seed=3, sharp=True)
    trajs = _trajs(9, seed=4)
    trajs[2].loss_mask[:] = [0] * len(trajs[2].loss_mask)  # nothing to score in this row
    batch = collate(trajs, 0, CPU)
    fed = _fed_positions(monkeypatch)
    with torch.no_grad():
        ref, ref_ent = token_logprobs(model, batch, entropy="metric", options=PLAIN)
        got, ent = token_logprobs(
            model, batch, entropy="metric", options=opts, score_mask=batch.loss_mask
        )
    m = batch.loss_mask.bool()
    m[:, 0] = False
    torch.testing.assert_close(got[m], ref[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[m], ref_ent[m], atol=1e-5, rtol=1e-5)
    assert torch.all(got[~m] == 0.0) and torch.all(ent[~m] == 0.0)
    cols = torch.arange(batch.input_ids.shape[1])
    need = torch.where(m, cols, 0).amax(dim=1)  # row b's inputs: positions 0 .. need-1
    assert int(need[2]) == 0 and int(need.max()) < batch.input_ids.shape[1]
    if opts.pack:
        assert fed == [int(need.sum())]  # packed: exactly the needed tokens, once each
    else:
        assert len(fed) == 1  # padded: the width is the longest need, not the longest row
        assert fed[0] <= int(batch.attention_mask[:, : int(need.max())].sum())


def test_tree_pack_drops_each_rows_last_token(make_tiny_model, monkeypatch):
    """GRPO groups (a shared prompt, G answers): the tree holds the prompt once and each
    answer without its last token, and log-probs and gradients equal the plain path."""
    model = make_tiny_model(seed=5, sharp=True)
    g = torch.Generator().manual_seed(0)
    trajs, expected = [], 0
    for k in range(3):
        prompt = [1, 10 + k, *torch.randint(4, 90, (4,), generator=g).tolist()]  # 6 tokens
        expected += len(prompt)
        for j in range(4):
            n = 1 + j % 3  # answers of 1..3 tokens, first tokens distinct within the group
            answer = [40 + j, *torch.randint(4, 90, (n - 1,), generator=g).tolist()]
            expected += n - 1  # the answer's last token is never an input
            ids = prompt + answer
            mask = [0] * len(prompt) + [1] * n
            trajs.append(Trajectory(ids, mask, [-0.5 * x for x in mask], 0.0, k, 0, 1, False, k))
    batch = collate(trajs, 0, CPU)
    adv = torch.linspace(-1.0, 1.0, len(trajs)).unsqueeze(-1)
    results = {}
    for name, opts in (("plain", PLAIN), ("tree", ScoringOptions())):
        fed = _fed_positions(monkeypatch)
        mdl = copy.deepcopy(model)
        logp, _ = token_logprobs(mdl, batch, options=opts, score_mask=batch.loss_mask)
        loss = -(logp * adv * batch.loss_mask).sum()
        loss.backward()
        results[name] = (logp.detach(), [p.grad.clone() for p in mdl.parameters()], list(fed))
    (lp0, g0, _), (lp1, g1, fed) = results["plain"], results["tree"]
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    assert fed == [expected]


def test_nothing_to_score_still_backpropagates(make_tiny_model):
    """A micro-batch whose loss mask is all zero (failed episodes) feeds nothing, but a loss
    built on it still backpropagates and every parameter gets a zero gradient, as when the
    forward ran."""
    model = make_tiny_model(seed=1)
    batch = collate(_trajs(3), 0, CPU)
    zero = torch.zeros_like(batch.loss_mask)
    logp, ent = token_logprobs(model, batch, entropy="metric", score_mask=zero)
    assert torch.all(logp == 0) and torch.all(ent == 0)
    (logp * 3.0).sum().backward()
    for p in model.parameters():
        assert p.grad is not None and torch.all(p.grad == 0)


def test_trim_switch_feeds_whole_rows(make_tiny_model, monkeypatch):
    """perf.score_trim=false (for measuring) feeds every real token of every row, and the scored
    log-probs do not change."""
    from gyre.config import load_config

    model = make_tiny_model(seed=2)
    batch = collate(_trajs(5, seed=7), 0, CPU)
    out = {}
    for trim in ("1", "0"):
        opts = ScoringOptions.from_perf(load_config(None, [f"perf.score_trim={trim}"]).perf)
        assert opts.trim == (trim == "1")
        fed = _fed_positions(monkeypatch)
        with torch.no_grad():
            lp, _ = token_logprobs(model, batch, options=opts)
        out[trim] = (lp, list(fed))
    n_real = int(batch.attention_mask.sum())
    lengths = batch.attention_mask.sum(1)
    width = int(lengths.max()) - 1  # trimmed: the longest row without its last token
    assert out["0"][1] == [n_real]
    assert out["1"][1] == [int(lengths.clamp(max=width).sum())]  # padded layout of that width
    torch.testing.assert_close(out["1"][0], out["0"][0], atol=1e-5, rtol=1e-5)
