"""TorchEngine: trainer/engine logprob agreement, KV reuse, batching and weight sync."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from gyre.engines import Engine, TorchEngine
from gyre.envs.maze import MazeEnv
from gyre.rollout.episodes import run_episodes, stop_ids
from gyre.trainer.batch import collate, token_logprobs
from gyre.types import GenerationRequest, SamplingParams
from helpers import RecordingEngine

CPU = torch.device("cpu")
SEEDS = [1, 4, 9]


def make_env():
    return MazeEnv(size=5, wall_density=0.3, min_distance=4, budget_factor=1.5)


def _masked_gap(model, trajs, pad_id, temperature, top_p):
    batch = collate(trajs, pad_id, CPU)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature, top_p)
    m = batch.loss_mask.bool()
    assert int(m.sum()) > 0
    return (logp[m] - batch.rollout_logprobs[m]).abs().max().item()


def test_torch_engine_satisfies_protocol(tokenizer, make_tiny_model):
    assert isinstance(TorchEngine(make_tiny_model(), tokenizer.pad_token_id), Engine)


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 0.9), (1.0, 1.0), (1.0, 0.8)])
def test_engine_logprobs_match_trainer(tokenizer, make_tiny_model, temperature, top_p):
    model = make_tiny_model(seed=2, sharp=True)
    engine = TorchEngine(model, tokenizer.pad_token_id, seed=0)
    params = SamplingParams(temperature, top_p, 3, stop_ids(tokenizer), seed=11)
    trajs = run_episodes(make_env, engine, tokenizer, SEEDS, 2, params)
    assert max(t.num_turns for t in trajs) > 1
    gap = _masked_gap(model, trajs, tokenizer.pad_token_id, temperature, top_p)
    assert gap < 1e-4
    # the comparison is sensitive: scoring under another distribution is far off
    assert _masked_gap(model, trajs, tokenizer.pad_token_id, 2.0, 1.0) > 1e-2


def _reuse_vs_fresh(tokenizer, model, params):
    """The same episodes through an engine that reuses KV caches and one that never can."""
    reuse = TorchEngine(model, tokenizer.pad_token_id, seed=0)
    fresh = RecordingEngine(
        TorchEngine(copy.deepcopy(model), tokenizer.pad_token_id, seed=0), strip_sessions=True
    )
    a = run_episodes(make_env, reuse, tokenizer, SEEDS, 2, params)
    b = run_episodes(make_env, fresh, tokenizer, SEEDS, 2, params)
    return a, b, reuse, fresh


def test_kv_reuse_matches_fresh_prefill_greedy(tokenizer, make_tiny_model):
    model = make_tiny_model(seed=3, sharp=True)
    params = SamplingParams(0.0, 1.0, 3, stop_ids(tokenizer), seed=0)
    a, b, reuse, fresh = _reuse_vs_fresh(tokenizer, model, params)
    assert max(t.num_turns for t in a) > 1
    assert len({t.num_turns for t in a}) > 1, "want episodes that end at different turns"
    for ta, tb in zip(a, b, strict=True):
        assert ta.token_ids == tb.token_ids
        assert ta.loss_mask == tb.loss_mask
        torch.testing.assert_close(
            torch.tensor(ta.rollout_logprobs),
            torch.tensor(tb.rollout_logprobs),
            atol=1e-5,
            rtol=0,
        )
    # the reusing engine really did reuse: it prefilled far fewer tokens
    assert reuse.stats["prefill_tokens"] < fresh.inner.stats["prefill_tokens"] / 2


def test_kv_reuse_matches_fresh_prefill_sampled(tokenizer, make_tiny_model):
    model = make_tiny_model(seed=4, sharp=True)
    params = SamplingParams(1.0, 1.0, 3, stop_ids(tokenizer), seed=123)
    a, b, _, _ = _reuse_vs_fresh(tokenizer, model, params)
    for ta, tb in zip(a, b, strict=True):
        assert ta.token_ids == tb.token_ids
        torch.testing.assert_close(
            torch.tensor(ta.rollout_logprobs),
            torch.tensor(tb.rollout_logprobs),
            atol=1e-5,
            rtol=0,
        )


def test_batched_equals_one_at_a_time(tokenizer, make_tiny_model):
    """Right-padded batching of prompts of different lengths changes nothing (greedy)."""
    model = make_tiny_model(seed=5, sharp=True)
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(t, add_special_tokens=False)]
        for t in ["#.A\nd1r1>", "..A..\n#####\nu3l1>", "7+5=", "..A..\n#####\nu3l1>"]
    ]
    params = SamplingParams(0.0, 1.0, 6, (), seed=0)
    batched = TorchEngine(model, tokenizer.pad_token_id).generate(
        [GenerationRequest(p) for p in prompts], params
    )
    for p, got in zip(prompts, batched, strict=True):
        alone = TorchEngine(model, tokenizer.pad_token_id).generate([GenerationRequest(p)], params)
        assert got.token_ids == alone[0].token_ids
        torch.testing.assert_close(
            torch.tensor(got.logprobs), torch.tensor(alone[0].logprobs), atol=1e-5, rtol=0
        )
        assert got.finish_reason == "length" and len(got.token_ids) == 6
        # greedy with no cache: check the first token by a plain forward pass
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p])).logits[0, -1]
        assert got.token_ids[0] == int(torch.argmax(logits))


def test_stop_token_ends_completion(tokenizer, make_tiny_model):
    model = make_tiny_model(seed=6, sharp=True)
    engine = TorchEngine(model, tokenizer.pad_token_id)
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("#.A\n", add_special_tokens=False)]
    free = engine.generate([GenerationRequest(prompt)], SamplingParams(0.0, 1.0, 5))[0]
    # make the second greedy token a stop token: generation must end right there
    stop = free.token_ids[1]
    out = engine.generate([GenerationRequest(prompt)], SamplingParams(0.0, 1.0, 5, (stop,)))[0]
    first_stop = free.token_ids.index(stop)
    assert out.token_ids == free.token_ids[: first_stop + 1]
    assert out.finish_reason == "stop"


def test_seeded_generation_reproducible(tokenizer, make_tiny_model):
    model = make_tiny_model(seed=7, sharp=True)
    engine = TorchEngine(model, tokenizer.pad_token_id, seed=0)
    reqs = [GenerationRequest([tokenizer.bos_token_id, 20, 21, 22]) for _ in range(4)]
    params = SamplingParams(1.0, 1.0, 8, (), seed=42)
    a = engine.generate(reqs, params)
    b = engine.generate(reqs, params)
    c = TorchEngine(copy.deepcopy(model), tokenizer.pad_token_id, seed=99).generate(reqs, params)
    assert [x.token_ids for x in a] == [x.token_ids for x in b] == [x.token_ids for x in c]
    # identical prompts in one batch still draw independent samples
    assert len({tuple(x.token_ids) for x in a}) > 1


def test_load_weights_syncs_and_stamps_version(tokenizer, make_tiny_model):
    src, dst = make_tiny_model(seed=8, sharp=True), make_tiny_model(seed=9, sharp=True)
    engine = TorchEngine(copy.deepcopy(dst), tokenizer.pad_token_id)
    reference = TorchEngine(src, tokenizer.pad_token_id)
    req = [GenerationRequest([tokenizer.bos_token_id, 30, 31], session="s")]
    params = SamplingParams(0.0, 1.0, 6)
    before = engine.generate(req, params)[0]
    engine.load_weights(src.state_dict(), version=3)
    assert engine.version == 3
    after = engine.generate(req, params)[0]
    expected = reference.generate(req, params)[0]
    assert after.token_ids == expected.token_ids
    assert before.token_ids != after.token_ids or before.logprobs != after.logprobs


def test_empty_prompt_rejected(tokenizer, make_tiny_model):
    engine = TorchEngine(make_tiny_model(), tokenizer.pad_token_id)
    with pytest.raises(ValueError):
        engine.generate([GenerationRequest([])], SamplingParams())
    assert engine.generate([], SamplingParams()) == []


def test_top_k_sampling_one_is_greedy_and_stays_in_the_k_most_likely(tokenizer, make_tiny_model):
    from dataclasses import replace

    from gyre.models.sampling import sampling_logprobs

    model = make_tiny_model(seed=8)
    engine = TorchEngine(model, tokenizer.pad_token_id, seed=0)
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("7+5=", add_special_tokens=False)]
    reqs = [GenerationRequest(prompt, seed=s) for s in range(6)]
    sampled = SamplingParams(1.0, 1.0, 6, (), top_logprobs=3)
    greedy = engine.generate(reqs[:1], replace(sampled, temperature=0.0))[0]
    for out in engine.generate(reqs, replace(sampled, top_k=1)):
        assert out.token_ids == greedy.token_ids and out.logprobs == [0.0] * 6
    outs = engine.generate(reqs, replace(sampled, top_k=3))
    assert outs == engine.generate(reqs, replace(sampled, top_k=3))  # keyed: reproducible
    assert len({tuple(o.token_ids) for o in outs}) > 1
    for out in outs:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + out.token_ids])).logits[0]
        logp = sampling_logprobs(logits[len(prompt) - 1 : -1], 1.0, 1.0, top_k=3)
        for t, (tok, lp, top) in enumerate(
            zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True)
        ):
            assert tok in logits[len(prompt) - 1 + t].topk(3).indices.tolist()
            assert lp == pytest.approx(logp[t, tok].item(), abs=1e-5)
            assert sum(math.exp(v) for v in top.values()) == pytest.approx(1.0, abs=1e-5)
