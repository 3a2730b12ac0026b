"""The engine's speed paths change nothing: prefix sharing, compaction, continuous batching,
session reuse and keyed sampling give the same tokens and logprobs as a plain engine that
serves one request at a time."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from gyre.engines import TorchEngine
from gyre.envs.maze import MazeEnv
from gyre.models.sampling import keyed_uniforms
from gyre.rollout.episodes import run_episodes, stop_ids, turn_seed
from gyre.types import Completion, GenerationRequest, SamplingParams


def _prompts(tokenizer) -> list[list[int]]:
    texts = ["#.A\nd1r1>", "..A..\n#####\nu3l1>", "7+5=", "12-3=", "x"]
    return [[tokenizer.bos_token_id, *tokenizer.encode(t, add_special_tokens=False)] for t in texts]


def _assert_same(a: list[Completion], b: list[Completion]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=5e-5, rtol=1e-5
        )


@pytest.mark.parametrize("max_batch_size", [0, 3])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.8, 0.9)])
def test_shared_compacted_equals_one_at_a_time(
    tokenizer, make_tiny_model, max_batch_size, temperature, top_p
):
    """Groups of identical prompts (prefix sharing), rows stopping at different steps
    (compaction), more requests than slots (continuous refill) == one request at a time."""
    model = make_tiny_model(seed=11, sharp=True)
    prompts = _prompts(tokenizer)
    # a stop token the sharp model does emit, so rows end at different steps
    stop = tuple(tokenizer.encode("1.", add_special_tokens=False))
    reqs = [
        GenerationRequest(p, seed=1000 * k + j) for k, p in enumerate(prompts) for j in range(4)
    ]
    params = SamplingParams(temperature, top_p, 12, stop)
    fast = TorchEngine(model, tokenizer.pad_token_id, max_batch_size=max_batch_size)
    got = fast.generate(reqs, params)
    plain = TorchEngine(
        copy.deepcopy(model), tokenizer.pad_token_id, prefix_sharing=False, compaction=False
    )
    want = [plain.generate([r], params)[0] for r in reqs]
    _assert_same(got, want)
    assert len({len(c.token_ids) for c in got}) > 1, "want rows that finish at different steps"
    # prefix sharing really prefilled each distinct prompt once (when all fit in one batch)
    if max_batch_size == 0:
        assert fast.stats["prefill_tokens"] == sum(len(p) for p in prompts)
    assert plain.stats["prefill_tokens"] == 4 * sum(len(p) for p in prompts)


def test_uncompacted_batch_equals_compacted(tokenizer, make_tiny_model):
    model = make_tiny_model(seed=12, sharp=True)
    stop = tuple(tokenizer.encode("1.", add_special_tokens=False))
    reqs = [GenerationRequest(p, seed=i) for i, p in enumerate(_prompts(tokenizer) * 2)]
    params = SamplingParams(1.0, 1.0, 10, stop)
    a = TorchEngine(model, tokenizer.pad_token_id, compaction=True).generate(reqs, params)
    static = TorchEngine(model, tokenizer.pad_token_id, compaction=False, prefix_sharing=False)
    _assert_same(a, static.generate(reqs, params))
    # the static batch kept decoding finished rows as padding; the compacted one did not
    assert static.stats["pad_tokens"] > 0


def test_continuous_follow_ups_reuse_sessions(tokenizer, make_tiny_model):
    """Follow-up requests admitted mid-decode continue their session's parked cache and match
    a fresh prefill of the whole prompt."""
    model = make_tiny_model(seed=13, sharp=True)
    prompts = _prompts(tokenizer)
    params = SamplingParams(1.0, 1.0, 5, tuple(tokenizer.encode("1", add_special_tokens=False)))
    obs = tokenizer.encode("\n#.>", add_special_tokens=False)
    turns = 3
    full: dict[int, list[int]] = {i: list(p) for i, p in enumerate(prompts)}
    episode_of = list(range(len(prompts)))
    turn = dict.fromkeys(range(len(prompts)), 0)
    log: list[tuple[int, list[int], Completion]] = []

    def on_complete(index: int, comp: Completion) -> GenerationRequest | None:
        i = episode_of[index]
        log.append((i, list(full[i]), comp))
        full[i] += comp.token_ids
        turn[i] += 1
        if turn[i] == turns:
            return None
        full[i] += obs
        episode_of.append(i)
        return GenerationRequest(list(full[i]), session=("s", i), seed=100 * i + turn[i])

    engine = TorchEngine(model, tokenizer.pad_token_id, max_batch_size=2, admit_ratio=0.0)
    first = [GenerationRequest(p, session=("s", i), seed=100 * i) for i, p in enumerate(prompts)]
    out = engine.generate_continuous(first, params, on_complete)
    assert len(out) == len(prompts) * turns == len(log)
    plain = TorchEngine(copy.deepcopy(model), tokenizer.pad_token_id)
    for i, prompt, comp in log:
        seed = 100 * i + sum(1 for j, p, _ in log if j == i and len(p) < len(prompt))
        alone = plain.generate([GenerationRequest(prompt, seed=seed)], params)[0]
        _assert_same([comp], [alone])
    # only the first turn of each episode was prefilled in full
    later = sum(len(obs) + len(c.token_ids) for i, p, c in log if len(p) > len(prompts[i]))
    assert engine.stats["prefill_tokens"] < sum(map(len, prompts)) + later + 1


def test_rollout_continuous_equals_lockstep(tokenizer, make_tiny_model):
    """Per-(episode, turn) seeds make the rollout independent of how turns are scheduled."""
    model = make_tiny_model(seed=14, sharp=True)
    params = SamplingParams(1.0, 1.0, 3, stop_ids(tokenizer), seed=5)

    def make_env():
        return MazeEnv(size=5, wall_density=0.3, min_distance=4, budget_factor=1.5)

    a = run_episodes(
        make_env,
        TorchEngine(model, tokenizer.pad_token_id),
        tokenizer,
        [1, 4],
        3,
        params,
        continuous=True,
    )
    b = run_episodes(
        make_env,
        TorchEngine(
            copy.deepcopy(model), tokenizer.pad_token_id, prefix_sharing=False, compaction=False
        ),
        tokenizer,
        [1, 4],
        3,
        params,
        continuous=False,
    )
    assert max(t.num_turns for t in a) > 1
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and x.loss_mask == y.loss_mask
        torch.testing.assert_close(
            torch.tensor(x.rollout_logprobs), torch.tensor(y.rollout_logprobs), atol=1e-5, rtol=0
        )


def test_keyed_uniforms_are_per_key_and_uniform():
    seeds = np.arange(20000, dtype=np.uint64)
    u = keyed_uniforms(seeds, np.zeros_like(seeds))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    # a row's draw depends only on its own (seed, counter)
    v = keyed_uniforms(seeds[5:6], np.zeros(1, dtype=np.uint64))
    assert float(v[0]) == float(u[5])
    w = keyed_uniforms(seeds[:1000], np.ones(1000, dtype=np.uint64))
    assert not torch.equal(w, u[:1000])
    assert turn_seed(None, 0, 0) is None
    assert turn_seed(1, 0, 0) != turn_seed(1, 0, 1) != turn_seed(1, 1, 0)


def test_top_logprobs_in_a_shared_batch_equal_one_at_a_time(tokenizer, make_tiny_model):
    """``top_logprobs`` (gyre serve's OpenAI ``logprobs``) come with the keyed, batched path:
    k entries per token, best first, the sampled token's logprob among them when it ranks."""
    model = make_tiny_model(seed=13, sharp=True)
    reqs = [GenerationRequest(p, seed=7 * i) for i, p in enumerate(_prompts(tokenizer) * 2)]
    params = SamplingParams(0.8, 0.95, 6, (), top_logprobs=3)
    got = TorchEngine(model, tokenizer.pad_token_id).generate(reqs, params)
    plain = TorchEngine(model, tokenizer.pad_token_id, prefix_sharing=False, compaction=False)
    want = [plain.generate([r], params)[0] for r in reqs]
    _assert_same(got, want)
    for c, w in zip(got, want, strict=True):
        assert c.top_logprobs is not None and w.top_logprobs is not None
        assert len(c.top_logprobs) == len(c.token_ids)
        for top, top_w, tok, lp in zip(
            c.top_logprobs, w.top_logprobs, c.token_ids, c.logprobs, strict=True
        ):
            assert list(top) == list(top_w) and len(top) == 3
            assert list(top.values()) == sorted(top.values(), reverse=True)
            if tok in top:
                assert top[tok] == pytest.approx(lp, abs=1e-5)
            else:
                assert lp <= min(top.values()) + 1e-5
    no_top = TorchEngine(model, tokenizer.pad_token_id).generate(
        reqs[:1], SamplingParams(0.8, 0.95, 6, ())
    )
    assert no_top[0].top_logprobs is None


def test_decode_step_follows_a_replaced_model(tokenizer, make_tiny_model):
    """``load_adapter`` / ``gyre serve`` replace ``engine.model`` (a peft wrapper); the decode
    step (compiled or not) must run the new object, never a stale one."""
    a, b = make_tiny_model(seed=1), make_tiny_model(seed=2)
    eager = TorchEngine(a, tokenizer.pad_token_id)
    assert eager.runner.decode_model() is a
    eager.model = b
    assert eager.runner.decode_model() is b
    compiled = TorchEngine(a, tokenizer.pad_token_id, compile_decode=True)
    first = compiled.runner.decode_model()  # torch.compile is lazy: nothing compiles until called
    assert compiled.runner.decode_model() is first
    compiled.model = b
    second = compiled.runner.decode_model()
    assert second is not first and compiled.runner._compiled_of is b
