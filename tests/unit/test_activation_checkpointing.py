"""perf.activation_checkpointing: the same log-probs and gradients, fewer saved activations."""

from __future__ import annotations

import copy

import pytest
import torch

from gyre.config import LoraConfig
from gyre.models.lean import checkpointed, enable_activation_checkpointing
from gyre.models.lora import apply_lora
from gyre.trainer.batch import collate, token_logprobs
from gyre.types import Trajectory

CPU = torch.device("cpu")


def _batch():
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(6):
        T = 10 + 3 * i
        ids = [1, *torch.randint(4, 90, (T - 1,), generator=g).tolist()]
        trajs.append(Trajectory(ids, [0] * 4 + [1] * (T - 4), [0.0] * T, 0.0, i // 2, 0, 1,
                                False, i))  # fmt: skip
    return collate(trajs, 0, CPU)


def _grads_and_saved(model, batch):
    """Log-probs, parameter gradients of their masked sum, and the bytes autograd saved."""
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = token_logprobs(model, batch, 1.0, 1.0)
    (logp * batch.loss_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), grads, saved[0]


@pytest.mark.parametrize("lora", [False, True], ids=["lean-full", "hf-lora"])
def test_checkpointing_equal_gradients_less_saved(make_tiny_model, lora):
    base = make_tiny_model(seed=1, sharp=True)
    if lora:
        base = apply_lora(base, LoraConfig(rank=4))
    batch = _batch()
    plain = copy.deepcopy(base)
    ckpt = copy.deepcopy(base)
    enable_activation_checkpointing(ckpt)
    assert checkpointed(ckpt.base_model.model if lora else ckpt) and not checkpointed(plain)
    lp_a, g_a, saved_a = _grads_and_saved(plain, batch)
    lp_b, g_b, saved_b = _grads_and_saved(ckpt, batch)
    torch.testing.assert_close(lp_b, lp_a, atol=1e-6, rtol=1e-6)
    assert g_a.keys() == g_b.keys() and g_a
    for name in g_a:
        torch.testing.assert_close(g_b[name], g_a[name], atol=1e-6, rtol=1e-5)
    assert saved_b < saved_a / 2
