"""The shared sampling distribution: temperature, top-p, greedy, seeding."""

from __future__ import annotations

import math

import torch

from gyre.models.sampling import sample_tokens, sampling_logprobs


def _logits(probs):
    return torch.log(torch.tensor([probs], dtype=torch.float32))


def test_plain_softmax():
    lp = sampling_logprobs(_logits([0.5, 0.3, 0.2]), 1.0, 1.0)
    torch.testing.assert_close(lp.exp(), torch.tensor([[0.5, 0.3, 0.2]]))


def test_temperature_scales_logits():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    lp = sampling_logprobs(logits, 0.5, 1.0)
    torch.testing.assert_close(lp, torch.log_softmax(logits / 0.5, dim=-1))
    # greedy (temperature 0) scores with the untempered softmax
    torch.testing.assert_close(sampling_logprobs(logits, 0.0, 1.0), torch.log_softmax(logits, -1))


def test_top_p_hand_values():
    # probs .4/.35/.25, top_p .5: mass before token 2 is .4 < .5 -> kept; before token 3 .75 -> cut
    lp = sampling_logprobs(_logits([0.4, 0.35, 0.25]), 1.0, 0.5)
    assert lp[0, 2].item() == -math.inf
    torch.testing.assert_close(
        lp[0, :2], torch.log(torch.tensor([0.4 / 0.75, 0.35 / 0.75])), atol=1e-6, rtol=0
    )
    # .6/.3/.1 with top_p .5: the top token alone reaches .5
    lp = sampling_logprobs(_logits([0.6, 0.3, 0.1]), 1.0, 0.5)
    assert lp[0, 0].item() == 0.0 and torch.isinf(lp[0, 1:]).all()


def test_top_p_unsorted_vocab_order():
    # the kept set is by probability, not by position
    lp = sampling_logprobs(_logits([0.1, 0.6, 0.05, 0.25]), 1.0, 0.8)
    kept = torch.isfinite(lp[0]).nonzero().flatten().tolist()
    assert kept == [1, 3]
    torch.testing.assert_close(lp[0, 1].exp(), torch.tensor(0.6 / 0.85))


def test_greedy_picks_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=g)
    tokens, logps = sample_tokens(logits, 0.0, 1.0, None)
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logps, expected)


def test_tiny_top_p_keeps_only_top_token():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 40, generator=g)
    tokens, logps = sample_tokens(logits, 1.0, 1e-6, torch.Generator().manual_seed(5))
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.all(logps == 0.0)


def test_seeded_sampling_reproducible_and_varied():
    logits = torch.zeros(8, 30)  # uniform
    a, la = sample_tokens(logits, 1.0, 1.0, torch.Generator().manual_seed(3))
    b, lb = sample_tokens(logits, 1.0, 1.0, torch.Generator().manual_seed(3))
    c, _ = sample_tokens(logits, 1.0, 1.0, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert not torch.equal(a, c)
    torch.testing.assert_close(la, torch.full((8,), -math.log(30)))


def test_samples_follow_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = torch.log(probs).expand(4000, 3)
    tokens, _ = sample_tokens(logits, 1.0, 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)
    # top_p=0.75 removes the .1 token (mass before it is .9 >= .75) -> never sampled
    tokens, logps = sample_tokens(logits, 1.0, 0.75, torch.Generator().manual_seed(0))
    assert (tokens != 2).all()
    assert torch.isfinite(logps).all()


def test_keyed_draw_equals_full_inverse_cdf_at_a_real_vocab_size():
    # the two-level inverse CDF picks the token a full float64 cumsum picks, at 49,152 + 5
    # tokens (not a multiple of the block), with the sampled tokens' log-probs of the softmax
    import numpy as np

    from gyre.models.sampling import keyed_uniforms, sample_tokens_keyed

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49157, generator=g) * 3
    seeds = np.arange(64, dtype=np.uint64) * 7 + 1
    counters = np.arange(64, dtype=np.uint64)
    tokens, logps = sample_tokens_keyed(logits, 1.0, 1.0, seeds, counters)
    full = torch.log_softmax(logits, -1)
    cdf = torch.cumsum(full.double().exp(), -1)
    u = keyed_uniforms(seeds, counters)[:, None] * cdf[:, -1:]
    expected = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(logps, full.gather(-1, tokens[:, None]).squeeze(-1))


def test_keyed_draw_never_picks_a_zero_weight_token():
    import numpy as np

    from gyre.models.sampling import inverse_cdf

    weights = torch.zeros(4000, 700)
    weights[:, [3, 255, 256, 600]] = torch.tensor([0.5, 0.2, 0.2, 0.1])
    u = torch.linspace(0, 1, 4000, dtype=torch.float64)  # includes the edges 0 and 1
    tokens, totals = inverse_cdf(weights, u)
    assert set(tokens.tolist()) == {3, 255, 256, 600}
    freq = torch.bincount(tokens, minlength=601)[[3, 255, 256, 600]].float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.2, 0.2, 0.1]), atol=2e-3, rtol=0)
    torch.testing.assert_close(totals, torch.ones(4000, dtype=torch.float64))
    assert np.isfinite(totals.numpy()).all()


def test_top_k_hand_values_then_top_p_over_what_is_left():
    # probs .4/.3/.2/.1: top_k=2 keeps .4/.3, renormalised to 4/7 and 3/7
    lp = sampling_logprobs(_logits([0.1, 0.4, 0.2, 0.3]), 1.0, 1.0, top_k=2)
    kept = torch.isfinite(lp[0]).nonzero().flatten().tolist()
    assert kept == [1, 3]
    torch.testing.assert_close(lp[0, [1, 3]].exp(), torch.tensor([4 / 7, 3 / 7]))
    # then top_p .5 over the renormalised 4/7, 3/7: 4/7 >= .5 alone
    lp = sampling_logprobs(_logits([0.1, 0.4, 0.2, 0.3]), 1.0, 0.5, top_k=2)
    assert lp[0, 1].item() == 0.0 and torch.isinf(lp[0, [0, 2, 3]]).all()
    # ties with the k-th logit are kept; k >= vocab or 0 is off
    lp = sampling_logprobs(_logits([0.4, 0.2, 0.2, 0.2]), 1.0, 1.0, top_k=2)
    assert torch.isfinite(lp).all()
    plain = sampling_logprobs(_logits([0.1, 0.4, 0.2, 0.3]), 1.0, 1.0)
    for k in (0, 4, 9):
        assert torch.equal(sampling_logprobs(_logits([0.1, 0.4, 0.2, 0.3]), 1.0, 1.0, k), plain)


def test_keyed_top_k_one_is_greedy_and_k_never_leaves_the_k_most_probable():
    import numpy as np

    from gyre.models.sampling import sample_tokens_keyed

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(512, 300, generator=g) * 2
    seeds = np.arange(512, dtype=np.uint64) * 3 + 5
    counters = np.arange(512, dtype=np.uint64) % 7
    tokens, logps = sample_tokens_keyed(logits, 1.3, 1.0, seeds, counters, top_k=1)
    assert torch.equal(tokens, logits.argmax(-1)) and torch.all(logps == 0.0)

    tokens, logps = sample_tokens_keyed(logits, 1.3, 1.0, seeds, counters, top_k=5)
    top5 = logits.topk(5, dim=-1).indices
    assert (tokens[:, None] == top5).any(-1).all()
    # the logprob is the truncated, renormalised distribution's
    want = torch.log_softmax(torch.gather(logits / 1.3, -1, top5), -1)
    got_at = (tokens[:, None] == top5).float().argmax(-1)
    torch.testing.assert_close(logps, want.gather(-1, got_at[:, None]).squeeze(-1))
    assert len(set(tokens.tolist())) > 5  # rows differ: not the argmax everywhere
    # the same (seed, counter) draws the same token; other seeds draw others
    again, lp_again = sample_tokens_keyed(logits, 1.3, 1.0, seeds, counters, top_k=5)
    assert torch.equal(tokens, again) and torch.equal(logps, lp_again)
    other, _ = sample_tokens_keyed(logits, 1.3, 1.0, seeds + 1, counters, top_k=5)
    assert not torch.equal(tokens, other)
