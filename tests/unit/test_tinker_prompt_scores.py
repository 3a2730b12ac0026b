"""What a Tinker sampling request asks about its prompt: targets (dense and sparse CSR),
alternative-token draws, and their checks, on a fixed table of logits."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gyre.tinker.errors import UserError
from gyre.tinker.prompt_scores import PromptAsk, check_alt_k, parse_targets, score_prompt


class Table(torch.nn.Module):
    """A 'model' whose next-token logits at position t are row t of a fixed table."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(logits, requires_grad=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.table[None, : input_ids.shape[1]])


LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.6, 0.2, 0.2], [1, 1, 1.0]]))


def test_dense_targets_are_the_untempered_logprobs_and_minus_one_gets_zero():
    targets = parse_targets(
        {"data": [1, -1, 2, 0, -1, -1], "dtype": "int64", "shape": [3, 2]}, 4, 3
    )
    ask = PromptAsk(targets=targets, temperature=0.5)  # temperature leaves targets untempered
    out = score_prompt(Table(LOGITS), (0, 1, 2, 0), ask, seed=0).targets
    assert out.csr is None and out.shape == (3, 2)
    want = np.log([[0.3, 1.0], [0.8, 0.1], [1.0, 1.0]]) * [[1, 0], [1, 1], [0, 0]]
    np.testing.assert_allclose(out.values.reshape(3, 2), want, atol=1e-6)


def test_sparse_targets_answer_in_the_same_layout():
    raw = {
        "data": [2, 0],
        "dtype": "int64",
        "shape": [3, 4],
        "sparse_crow_indices": [0, 1, 1, 2],
        "sparse_col_indices": [3, 0],
    }
    out = score_prompt(Table(LOGITS), (0, 1, 2, 0), PromptAsk(targets=parse_targets(raw, 4, 3)), 0)
    assert out.targets.csr == ([0, 1, 1, 2], [3, 0]) and out.targets.shape == (3, 4)
    np.testing.assert_allclose(out.targets.values, np.log([0.2, 0.6]), atol=1e-6)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"data": [1, 2], "dtype": "float32", "shape": [2, 1]}, "int64 tensor"),
        ({"data": [1, 2], "dtype": "int64", "shape": [2, 1]}, r"shape \[2, 1\], need \[3, K\]"),
        ({"data": [1, 2], "dtype": "int64", "shape": [3, 1]}, "2 values do not fill"),
        ({"data": [-1, -1, -1], "dtype": "int64", "shape": [3, 1]}, "names no token id"),
        ({"data": [1, 3, 0], "dtype": "int64", "shape": [3, 1]}, r"in \[0, 3\)"),
        (
            {
                "data": [1],
                "dtype": "int64",
                "shape": [3, 2],
                "sparse_crow_indices": [0, 1, 1, 1],
                "sparse_col_indices": [2],
            },
            "malformed sparse",
        ),
    ],
)
def test_bad_targets_are_refused_naming_the_field(raw, message):
    with pytest.raises(UserError, match=message) as err:
        parse_targets(raw, 4, 3)
    assert err.value.message.startswith("target_prompt_logprobs")


def test_alternative_tokens_are_seeded_draws_with_the_models_logprobs():
    model = Table(LOGITS)
    draws = score_prompt(model, (0, 1, 2, 0), PromptAsk(alt_k=400), seed=3).alt
    again = score_prompt(model, (0, 1, 2, 0), PromptAsk(alt_k=400), seed=3).alt
    other = score_prompt(model, (0, 1, 2, 0), PromptAsk(alt_k=400), seed=4).alt
    ids, lps = draws
    assert ids.shape == lps.shape == (3, 400)
    assert np.array_equal(ids, again[0]) and not np.array_equal(ids, other[0])
    want = np.log(LOGITS.exp().numpy()[np.arange(3)[:, None], ids])
    np.testing.assert_allclose(lps, want, atol=1e-6)
    freq = np.stack([np.bincount(r, minlength=3) / 400 for r in ids])
    np.testing.assert_allclose(freq, LOGITS.exp()[:3].numpy(), atol=0.08)
    # temperature 0: the argmax, k times; a lower temperature draws the argmax more often
    greedy = score_prompt(model, (0, 1, 2, 0), PromptAsk(alt_k=4, temperature=0.0), 0).alt[0]
    assert (greedy == np.array([[0], [2], [0]])).all()
    cold = score_prompt(model, (0, 1, 2, 0), PromptAsk(alt_k=400, temperature=0.3), 3).alt[0]
    assert (cold[1] == 2).mean() > (ids[1] == 2).mean()
    with pytest.raises(UserError, match="prompt_alt_tokens_k"):
        check_alt_k(101)
