"""The GRPO update is bitwise reproducible at two threads (docs/operations.md, "Guarantees").

The op that was not: the gather of the predicting states in ``gyre.trainer.scoring``, whose
advanced-indexing backward (``index_put_`` accumulate) adds tree packing's repeated positions
with parallel float atomics. These tests run torch at 2 threads (the conftest pins 1).
"""

from __future__ import annotations

import copy

import torch

from gyre.trainer import scoring
from gyre.trainer.batch import collate
from gyre.trainer.scoring import gather_states
from gyre.trainer.update import policy_update
from gyre.types import Trajectory
from helpers import train_cfg


def _repeated_gather(
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A (4, 300, 64) hidden tensor, 2000 positions drawn from 60 (heavy repeats) and an
    upstream gradient: N x H = 128000 elements, past torch's parallel grain (32768)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(4, 300, 64, generator=g)
    rows = torch.randint(0, 4, (2000,), generator=g)
    cols = torch.randint(0, 15, (2000,), generator=g)
    return hidden, rows, cols, torch.randn(2000, 64, generator=g)


def _grad(fn, hidden: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    x = hidden.clone().requires_grad_(True)
    fn(x).backward(up)
    assert x.grad is not None
    return x.grad


def test_gather_backward_is_reproducible_at_two_threads():
    """Repeated rows: 12 backward passes at 2 threads give one result, and it is bitwise the
    one-thread advanced-indexing result (so run.threads=1 numerics did not move)."""
    hidden, rows, cols, up = _repeated_gather()
    old_one_thread = _grad(lambda x: x[rows, cols], hidden, up)
    assert torch.equal(gather_states(hidden, rows, cols), hidden[rows, cols])
    torch.set_num_threads(2)
    grads = [_grad(lambda x: gather_states(x, rows, cols), hidden, up) for _ in range(12)]
    assert all(torch.equal(g, old_one_thread) for g in grads)


def _groups(n_groups: int = 6, size: int = 8) -> list[Trajectory]:
    """GRPO groups: a shared 60-token prompt and 8 answers of 16-32 tokens, all in the loss
    (about 1150 scored positions x hidden 32: past torch's parallel grain of 32768 elements);
    rewards 0/1 within each group so every row trains. Rows are shuffled, as a mini-batch's
    are: a group's repeated position is then gathered from both halves of the batch (the two
    threads' shares), where the atomics race."""
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(n_groups):
        prompt = [1, *torch.randint(4, 90, (59,), generator=g).tolist()]
        for j in range(size):
            n = int(torch.randint(16, 33, (1,), generator=g))
            answer = [40 + j, *torch.randint(4, 90, (n - 1,), generator=g).tolist()]
            mask = [0] * len(prompt) + [1] * n
            lps = [-1.0 * m for m in mask]
            out.append(Trajectory(prompt + answer, mask, lps, float(j % 2), k, 0, 1, False, k))
    return [out[i] for i in torch.randperm(len(out), generator=g).tolist()]


def test_grpo_update_is_bitwise_reproducible_at_two_threads(make_tiny_model, monkeypatch):
    """Two AdamW policy updates from the same state at 2 threads, on a tree-packed batch whose
    gather repeats positions: bitwise the same weights."""
    model = make_tiny_model(seed=7, sharp=True)
    trajs = _groups()
    adv = torch.tensor([t.reward - 0.5 for t in trajs])
    settings = train_cfg(  # GRPOSettings' old defaults, stated
        micro_batch_size=64, loss_agg="seq-mean-token-mean", mini_batches=1, old_logprobs="rollout"
    )
    repeats = []

    def spy(hidden: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        flat = rows * hidden.shape[1] + cols
        repeats.append(len(flat) - len(torch.unique(flat)))
        return gather_states(hidden, rows, cols)

    monkeypatch.setattr(scoring, "gather_states", spy)
    torch.set_num_threads(2)
    results = []
    for _ in range(2):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        policy_update(m, opt, collate(trajs, 0, torch.device("cpu")), adv, settings)
        results.append([p.detach().clone() for p in m.parameters()])
    assert repeats and min(repeats) > 0, "the batch must be tree-packed with repeated positions"
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))
