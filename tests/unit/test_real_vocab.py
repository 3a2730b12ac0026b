"""A real model's vocabulary size (SmolLM2's 49,152) through the trainer's chunked log-probs and
the engine's sampler, on a random 1-layer Llama built from a config (no download)."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from gyre.engines import TorchEngine
from gyre.trainer.batch import collate, token_logprobs
from gyre.trainer.scoring import ScoringOptions
from gyre.types import GenerationRequest, SamplingParams, Trajectory

VOCAB = 49_152
CPU = torch.device("cpu")


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _trajs(n: int, length: int) -> list[Trajectory]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        mask = [0] * 8 + [1] * (length - 8)
        out.append(Trajectory(ids, mask, [0.0] * length, 0.0, i // 4, 0, 1, False, i))
    return out


def test_chunked_logprobs_never_hold_all_positions_logits_at_49k_vocab():
    # 8 rows x 40 tokens: 312 predicting positions. Chunks of 64 positions: no op (forward or
    # backward) may produce a tensor bigger than one chunk's logits, 64 x 49,152, while the
    # unchunked path makes the 312 x 49,152 one; both give the same log-probs and gradients.
    model = _model()
    batch = collate(_trajs(8, 40), 0, CPU)
    real = batch.attention_mask.bool()
    results = {}
    for name, opts in (("plain", ScoringOptions(pack=False, chunk=0)), ("chunked", None)):
        opts = opts or ScoringOptions(pack=True, chunk=64)
        model.zero_grad()
        with LargestTensor() as seen:
            logp, _ = token_logprobs(model, batch, 1.0, 1.0, options=opts)
            (logp * batch.loss_mask).sum().backward()
        grad = model.model.embed_tokens.weight.grad.clone()
        results[name] = (logp.detach(), grad, seen.numel)
    n_pred = int(real.sum()) - 8
    assert results["plain"][2] >= n_pred * VOCAB  # the full logits do exist on the plain path
    assert results["chunked"][2] <= 64 * VOCAB
    torch.testing.assert_close(
        results["chunked"][0][real], results["plain"][0][real], atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(results["chunked"][1], results["plain"][1], atol=1e-6, rtol=1e-4)


def test_engine_and_trainer_logprobs_agree_at_49k_vocab():
    model = _model()
    engine = TorchEngine(model, pad_token_id=0, seed=0)
    prompts = [[1, 5, 900, 40_000], [1, 7, 49_151, 3, 12]]
    reqs = [GenerationRequest(p, seed=s) for p in prompts for s in range(3)]
    outs = engine.generate(reqs, SamplingParams(1.0, 1.0, 12, (), seed=None))
    trajs = []
    for k, (r, o) in enumerate(zip(reqs, outs, strict=True)):
        n, m = len(r.prompt_ids), len(o.token_ids)
        ids, lps = [*r.prompt_ids, *o.token_ids], [0.0] * n + list(o.logprobs)
        trajs.append(Trajectory(ids, [0] * n + [1] * m, lps, 0.0, k // 3, 0, 1, False, k))
    batch = collate(trajs, 0, CPU)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, 1.0, 1.0)
    m = batch.loss_mask.bool()
    gap = (logp[m] - batch.rollout_logprobs[m]).abs().max().item()
    assert gap < 1e-4
    # sampled from a (near-uniform) 49k distribution: tokens spread over the vocabulary
    drawn = np.array([t for o in outs for t in o.token_ids])
    assert drawn.max() > VOCAB // 2 and len(set(drawn.tolist())) > len(drawn) // 2
