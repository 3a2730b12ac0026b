"""The lean forward (gyre.models.lean) equals the Hugging Face forward: logits (prefill, cached
decode,
packed, tree-packed), engine tokens and log-probs, training log-probs and gradients; and it
falls back, saying why, for anything it does not implement."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from gyre.engines import TorchEngine
from gyre.models.lean import LeanForward, _append_kv, lean_for, unsupported_reason
from gyre.trainer.batch import collate, token_logprobs
from gyre.trainer.packing import pack_rows, plan_tree, tree_pack
from gyre.trainer.scoring import ScoringOptions
from gyre.trainer.update import policy_update
from gyre.types import GenerationRequest, SamplingParams, Trajectory
from helpers import train_cfg

CPU = torch.device("cpu")
PLAIN = ScoringOptions(pack=False, chunk=0, lean=False, share_prefix=False)
SMALL = {"vocab_size": 61, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}


def _sharp(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5, generator=g)
    return model.eval()


def _models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {
        "llama-tied": LlamaForCausalLM(
            LlamaConfig(**SMALL, num_attention_heads=4, tie_word_embeddings=True)
        ),
        "llama-gqa-bias-untied-llama3rope": LlamaForCausalLM(
            LlamaConfig(
                **SMALL,
                num_attention_heads=4,
                num_key_value_heads=2,
                attention_bias=True,
                tie_word_embeddings=False,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            )
        ),
        "qwen2": Qwen2ForCausalLM(
            Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2)
        ),
        "mistral-no-window": MistralForCausalLM(
            MistralConfig(
                **SMALL, num_attention_heads=4, num_key_value_heads=4, sliding_window=None
            )
        ),
    }


MODELS = _models()


@pytest.mark.parametrize("name", list(MODELS))
def test_lean_logits_equal_hf(name):
    model = _sharp(copy.deepcopy(MODELS[name]), 1)
    lean = lean_for(model)
    assert lean is not None, unsupported_reason(model)
    g = torch.Generator().manual_seed(2)
    B, T = 3, 9
    ids = torch.randint(0, SMALL["vocab_size"], (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 6:] = 0  # right padding
    pos = torch.arange(T)[None].expand(B, T)
    with torch.no_grad():
        # full prefill of a right-padded batch
        ref = model(input_ids=ids, attention_mask=am).logits
        got = lean.logits(lean.hidden(ids, pos, lean.padded_mask(am, torch.float32)))
        real = am.bool()
        torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=1e-5)
        # prefill of 5 tokens into a cache, then cached one-token decode steps
        hf_cache, lean_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
        ref = model(input_ids=ids[:, :5], cache=hf_cache, use_cache=True).logits
        colmask = torch.ones(B, 5, dtype=torch.long)
        got = lean.logits(
            lean.hidden(
                ids[:, :5], pos[:, :5], lean.cached_mask(colmask, 5, torch.float32), lean_cache
            )
        )
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        for t in range(5, T):
            ref = model(
                input_ids=ids[:, t : t + 1],
                position_ids=pos[:, t : t + 1],
                cache=hf_cache,
                use_cache=True,
            ).logits
            colmask = torch.cat([colmask, torch.ones(B, 1, dtype=torch.long)], dim=1)
            h = lean.hidden(
                ids[:, t : t + 1],
                pos[:, t : t + 1],
                lean.cached_mask(colmask, 1, torch.float32),
                lean_cache,
            )
            torch.testing.assert_close(lean.logits(h), ref, atol=1e-5, rtol=1e-5)
        # packed: two sequences in one row, position ids restarting
        a, b = ids[0, :4], ids[2, :5]
        packed_ids = torch.cat([a, b])[None]
        packed_pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
        got = lean.logits(
            lean.hidden(packed_ids, packed_pos, lean.segment_mask(packed_pos, torch.float32))
        )
        torch.testing.assert_close(
            got[0, :4], model(input_ids=a[None]).logits[0], atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            got[0, 4:], model(input_ids=b[None]).logits[0], atol=1e-5, rtol=1e-5
        )


def test_tree_pack_logits_equal_rows():
    """Rows sharing a prompt, laid out as one tree, give every row its own logits."""
    model = _sharp(copy.deepcopy(MODELS["llama-gqa-bias-untied-llama3rope"]), 3)
    lean = lean_for(model)
    assert lean is not None
    prompt = [5, 9, 11, 2, 7]
    rows = [[*prompt, 1, 2, 3], [*prompt, 4], prompt, [*prompt, 1, 2, 8, 8], [3, 3, 1]]
    tree = tree_pack(rows, 0, CPU)
    assert tree.input_ids.numel() < sum(len(r) for r in rows)  # the prompt is stored once
    with torch.no_grad():
        mask = LeanForward.additive(tree.allowed[:, None], torch.float32)
        logits = lean.logits(lean.hidden(tree.input_ids, tree.position_ids, mask))
        for i, row in enumerate(rows):
            want = model(input_ids=torch.tensor([row])).logits[0]
            got = logits[tree.loc_row[i], tree.loc_col[i]]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _group_trajs(groups: int = 3, size: int = 4, seed: int = 0) -> list[Trajectory]:
    """GRPO-shaped trajectories: each group repeats one prompt, completions differ."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(groups):
        prompt = [
            1,
            *torch.randint(
                4, 60, (int(torch.randint(6, 14, (1,), generator=g)),), generator=g
            ).tolist(),
        ]
        for _ in range(size):
            n = int(torch.randint(1, 6, (1,), generator=g))
            comp = torch.randint(4, 60, (n,), generator=g).tolist()
            ids = prompt + comp
            mask = [0] * len(prompt) + [1] * n
            lps = [-(0.5 + float(torch.rand(1, generator=g))) * m for m in mask]
            out.append(Trajectory(ids, mask, lps, 0.0, k, 0, 1, False, len(out)))
    return out


def _varied_trajs(n: int = 8, seed: int = 0) -> list[Trajectory]:
    """Rows of very different lengths (3..29 tokens): packable."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = 3 + (26 * i) // (n - 1)
        ids = [1, *torch.randint(4, 60, (T - 1,), generator=g).tolist()]
        mask = [0, *(torch.rand(T - 1, generator=g) < 0.6).long().tolist()]
        lps = [-(0.5 + float(torch.rand(1, generator=g))) * m for m in mask]
        out.append(Trajectory(ids, mask, lps, 0.0, i // 2, 0, 1, False, i))
    return out


FAST = {
    "lean-tree": ScoringOptions(pack=True, chunk=4, lean=True, share_prefix=True),
    "lean-packed": ScoringOptions(pack=True, chunk=0, lean=True, share_prefix=False),
    "lean-padded": ScoringOptions(pack=False, chunk=5, lean=True, share_prefix=False),
}


@pytest.mark.parametrize("opts", list(FAST.values()), ids=list(FAST))
def test_lean_training_logprobs_equal_plain(make_tiny_model, opts):
    model = make_tiny_model(seed=3, sharp=True)
    batch = collate(_group_trajs() if opts.share_prefix else _varied_trajs(), 0, CPU)
    lengths = [int(n) for n in batch.attention_mask.sum(1)]
    if opts.share_prefix:  # the tree layout is really chosen for this batch
        assert plan_tree(model, batch.input_ids, lengths, 0, tuple(batch.input_ids.shape))
    if opts.pack and not opts.share_prefix:
        assert pack_rows(batch.input_ids, lengths, 0).num_positions < 0.9 * batch.input_ids.numel()
    with torch.no_grad():
        ref, ref_ent = token_logprobs(model, batch, 0.8, 0.9, True, options=PLAIN)
        got, ent = token_logprobs(model, batch, 0.8, 0.9, True, options=opts)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[real], ref_ent[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["lean-tree", "lean-packed"])
def test_lean_update_gradients_equal_plain(make_tiny_model, name):
    """One GRPO step through the lean (tree-packed) path: same loss and gradients as plain."""
    base = make_tiny_model(seed=5, sharp=True)
    opts = FAST[name]
    trajs = _group_trajs(seed=1) if opts.share_prefix else _varied_trajs(seed=1)
    adv = torch.linspace(-1.5, 1.5, len(trajs))
    results = {}
    for label, scoring in (
        ("plain", PLAIN),
        ("fast", ScoringOptions(pack=True, chunk=opts.chunk, share_prefix=opts.share_prefix)),
    ):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        m = policy_update(
            model,
            opt,
            collate(trajs, 0, CPU),
            adv,
            train_cfg(
                micro_batch_size=64,
                max_grad_norm=1e9,
                mini_batches=1,
                loss_agg="token-mean",
                old_logprobs="rollout",
            ),
            scoring=scoring,
        )
        results[label] = (m, [p.grad.detach().clone() for p in model.parameters()])
    (mp, gp), (mf, gf) = results["plain"], results["fast"]
    assert abs(mp["train/loss"]) > 1e-3
    assert mf["train/loss"] == pytest.approx(mp["train/loss"], abs=1e-6, rel=1e-5)
    for a, b in zip(gp, gf, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)


def test_engine_lean_equals_hf_forward(tokenizer, make_tiny_model):
    """Same seeds: the engine on the lean forward samples the same tokens, with the same
    log-probs (1e-5), as on the HF forward -- groups, early stops, parked multi-turn sessions."""
    model = make_tiny_model(seed=11, sharp=True)
    enc = [tokenizer.encode(t, add_special_tokens=False) for t in ("#.A\nd1r1>", "7+5=", "x")]
    prompts = [[tokenizer.bos_token_id, *e] for e in enc]
    stop = tuple(tokenizer.encode("1.", add_special_tokens=False))
    params = SamplingParams(0.9, 0.95, 10, stop)
    outs = {}
    for lean in (True, False):
        engine = TorchEngine(copy.deepcopy(model), tokenizer.pad_token_id, lean_forward=lean)
        assert (engine.runner.lean() is not None) == lean
        reqs = [
            GenerationRequest(p, session=(k, j), seed=100 * k + j)
            for k, p in enumerate(prompts)
            for j in range(3)
        ]
        first = engine.generate(reqs, params)
        follow = [  # second turn: continue each parked session with a new observation
            GenerationRequest(r.prompt_ids + c.token_ids + enc[1], session=r.session, seed=7 + i)
            for i, (r, c) in enumerate(zip(reqs, first, strict=True))
        ]
        outs[lean] = first + engine.generate(follow, params)
    assert len({len(c.token_ids) for c in outs[True]}) > 1, "want rows stopping early"
    for a, b in zip(outs[True], outs[False], strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5
        )


def test_append_kv_keeps_earlier_views():
    """An in-place append never changes a view taken earlier (the engine's parked snapshots)."""
    cache = DynamicCache(config=MODELS["llama-tied"].config)
    layer = cache.layers[0]
    k0 = torch.randn(2, 4, 3, 8)
    _append_kv(layer, k0, k0 + 1)
    snap_k, snap_v = layer.keys, layer.values
    for _ in range(40):  # past the first capacity: reallocates, then appends in place again
        _append_kv(layer, torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8))
    assert torch.equal(snap_k, k0) and torch.equal(snap_v, k0 + 1)
    assert layer.keys.shape[2] == 43 and torch.equal(layer.keys[:, :, :3], k0)


def test_unsupported_models_fall_back_and_say_why(caplog):
    gelu = LlamaForCausalLM(LlamaConfig(**SMALL, num_attention_heads=4, hidden_act="gelu"))
    dynamic = LlamaForCausalLM(
        LlamaConfig(
            **SMALL, num_attention_heads=4, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
        )
    )
    window = MistralForCausalLM(
        MistralConfig(**SMALL, num_attention_heads=4, num_key_value_heads=4, sliding_window=4)
    )
    with caplog.at_level(logging.WARNING, logger="gyre.models.lean"):
        assert lean_for(gelu) is None
        assert lean_for(gelu) is None  # logged once
        assert lean_for(dynamic) is None
        assert lean_for(window) is None
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("hidden_act" in m for m in msgs) == 1
    assert any("rope type 'dynamic'" in m for m in msgs)
    assert any("sliding-window" in m for m in msgs)
    assert lean_for(MODELS["llama-tied"], enabled=False) is None
    # FSDP2's fully_shard swaps the class (FSDP<Name>) and shards parameters as DTensors
    sharded_cls = type("FSDPLlamaForCausalLM", (LlamaForCausalLM,), {})
    sharded = sharded_cls(LlamaConfig(**SMALL, num_attention_heads=4))
    assert "FSDP" in str(unsupported_reason(sharded))


def test_shared_prefix_decode_attention_equals_per_row(tokenizer, make_tiny_model, monkeypatch):
    """Forked group prompts are attended once per group in decode; tokens and log-probs are
    those of per-row attention (shared_prefix_attention=False) and of the HF forward, with rows of a
    group finishing at different steps (compaction re-indexes the groups)."""
    import gyre.models.lean as lean_mod
    import gyre.models.lean_decode as decode_mod

    model = make_tiny_model(seed=21, sharp=True)
    texts = ["#.A..\n#####\nu3l1>", "..A..\n.#.#.\nd1>", "12-3=456+"]
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(t, add_special_tokens=False)] for t in texts
    ]
    assert min(len(p) for p in prompts) >= decode_mod.SHARED_PREFIX_MIN
    reqs = [GenerationRequest(p, seed=10 * k + j) for k, p in enumerate(prompts) for j in range(5)]
    stop = tuple(tokenizer.encode("1.", add_special_tokens=False))
    params = SamplingParams(1.0, 1.0, 12, stop)
    calls = []
    real = lean_mod.cascade_attention  # patched where LeanForward.hidden calls it

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(lean_mod, "cascade_attention", spy)
    real_attend = decode_mod._Group.attend

    def spy_attend(*a, **k):
        calls.append(2)
        return real_attend(*a, **k)

    monkeypatch.setattr(decode_mod._Group, "attend", spy_attend)
    outs = {}
    for name, shared, lean in (
        ("shared", True, True),
        ("per_row", False, True),
        ("hf", True, False),
    ):
        n = len(calls)
        engine = TorchEngine(
            copy.deepcopy(model),
            tokenizer.pad_token_id,
            lean_forward=lean,
            compact_min=0.0,
            shared_prefix_attention=shared,
        )
        outs[name] = engine.generate(reqs, params)
        assert (len(calls) > n) == (name == "shared")
        if name == "shared":
            # grouped decode of the fresh groups, then (compaction un-groups the cache) the
            # per-group prefix attention over the per-row layout
            assert set(calls[n:]) == {1, 2}, sorted(set(calls[n:]))
    assert len({len(c.token_ids) for c in outs["shared"]}) > 1, "want rows stopping early"
    for other in ("per_row", "hf"):
        for a, b in zip(outs["shared"], outs[other], strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5
            )


def test_lora_injected_after_build_falls_back():
    """peft replaces projections in place: a lean forward built before must not ignore them."""
    peft = pytest.importorskip("peft")
    model = copy.deepcopy(MODELS["llama-tied"])
    assert lean_for(model) is not None
    wrapped = peft.get_peft_model(
        model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj"], lora_dropout=0.0)
    )
    assert lean_for(wrapped) is None
    assert lean_for(model) is None  # the base model now holds LoRA layers


def test_grouped_decode_parks_compacts_and_continues(tokenizer, make_tiny_model, monkeypatch):
    """Forked groups decode in the grouped layout; rows finishing park their session from a
    lazily written snapshot, compaction writes the live rows back to the per-row layout, and
    follow-up turns continue the parked caches: every completion equals the HF-forward engine
    generating that prompt alone."""
    import gyre.engines.kv_batch as kv_batch
    import gyre.models.lean_decode as decode_mod

    model = make_tiny_model(seed=22, sharp=True)
    texts = ["#.A..\n#####\nu3l1>", "12-3=456+", "#.A..\n#####\nu3l1>"]  # a task drawn twice
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(t, add_special_tokens=False)] for t in texts
    ]
    G = 4
    used = {"attend": 0, "snapshot_written": 0}
    real_attend, real_mat = decode_mod._Group.attend, kv_batch.KVSnapshot._materialize

    def attend(*a, **k):
        used["attend"] += 1
        return real_attend(*a, **k)

    def materialize(self):
        used["snapshot_written"] += self._groups is not None
        return real_mat(self)

    monkeypatch.setattr(decode_mod._Group, "attend", attend)
    monkeypatch.setattr(kv_batch.KVSnapshot, "_materialize", materialize)
    params = SamplingParams(1.0, 1.0, 6, tuple(tokenizer.encode("1.", add_special_tokens=False)))
    obs = tokenizer.encode("\n#.>", add_special_tokens=False)
    n = len(prompts) * G
    full = {i: list(prompts[i // G]) for i in range(n)}
    episode_of, turn = list(range(n)), dict.fromkeys(range(n), 0)
    log: list[tuple[int, list[int], object]] = []

    def on_complete(index, comp):
        i = episode_of[index]
        log.append((i, list(full[i]), comp))
        full[i] += comp.token_ids
        turn[i] += 1
        if turn[i] == 2:
            return None
        full[i] += obs
        episode_of.append(i)
        return GenerationRequest(list(full[i]), session=("g", i), seed=100 * i + turn[i])

    engine = TorchEngine(copy.deepcopy(model), tokenizer.pad_token_id, compact_min=0.0)
    first = [GenerationRequest(list(full[i]), session=("g", i), seed=100 * i) for i in range(n)]
    engine.generate_continuous(first, params, on_complete)
    assert used["attend"] > 0 and used["snapshot_written"] > 0, used
    assert len(log) == 2 * n
    plain = TorchEngine(copy.deepcopy(model), tokenizer.pad_token_id, lean_forward=False)
    for i, prompt, comp in log:
        seed = 100 * i + (len(prompt) > len(prompts[i // G]))
        alone = plain.generate([GenerationRequest(prompt, seed=seed)], params)[0]
        assert comp.token_ids == alone.token_ids
        torch.testing.assert_close(
            torch.tensor(comp.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=1e-5
        )


def test_grouped_decode_switches_to_rows_after_max_steps(tokenizer, make_tiny_model, monkeypatch):
    """Past GROUP_MAX_STEPS decode steps a grouped cache is written back to the per-row layout
    mid-decode; tokens and log-probs stay those of per-row attention."""
    import gyre.models.lean_decode as decode_mod

    model = make_tiny_model(seed=23, sharp=True)
    texts = ["#.A..\n#####\nu3l1>", "12-3=456+"]
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(t, add_special_tokens=False)] for t in texts
    ]
    reqs = [GenerationRequest(p, seed=10 * k + j) for k, p in enumerate(prompts) for j in range(4)]
    params = SamplingParams(1.0, 1.0, 10, ())
    monkeypatch.setattr(decode_mod, "GROUP_MAX_STEPS", 3)
    steps = []
    real = decode_mod._Group.attend

    def attend(self, *a, **k):
        steps.append(self.steps)
        return real(self, *a, **k)

    monkeypatch.setattr(decode_mod._Group, "attend", attend)
    grouped = TorchEngine(copy.deepcopy(model), tokenizer.pad_token_id).generate(reqs, params)
    assert steps and max(steps) == 2  # steps 0, 1, 2 grouped, then per-row
    rows = TorchEngine(
        copy.deepcopy(model), tokenizer.pad_token_id, shared_prefix_attention=False
    ).generate(reqs, params)
    for a, b in zip(grouped, rows, strict=True):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 10
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5
        )


def test_fused_weights_follow_in_place_updates_that_keep_versions(tokenizer, make_tiny_model):
    """torch.optim.AdamW(fused=True) changes parameters in place without bumping _version: the
    lean forward must not serve fused Q/K/V / gate-up weights cached from before such a step
    (an engine sharing the trainer's model, or no-grad scoring after the update)."""
    model = make_tiny_model(seed=24, sharp=True)
    engine = TorchEngine(model, tokenizer.pad_token_id)  # shares the trainer's parameters
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("12-3=456+", add_special_tokens=False)]
    reqs = [GenerationRequest(prompt, seed=k) for k in range(4)]
    params = SamplingParams(1.0, 1.0, 6, ())
    engine.generate(reqs, params)  # builds (and used to keep) the fused weights
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    versions = [p._version for p in model.parameters()]
    opt.step()
    assert [p._version for p in model.parameters()] == versions  # the trap itself
    after = engine.generate(reqs, params)
    fresh = TorchEngine(copy.deepcopy(model), tokenizer.pad_token_id).generate(reqs, params)
    for a, b in zip(after, fresh, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
    lean = lean_for(model)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        mask = LeanForward.additive(
            torch.ones(1, 1, len(prompt), len(prompt)).tril().bool(), torch.float32
        )
        ours = lean.logits(lean.hidden(ids, torch.arange(len(prompt))[None], mask))
        ref = model(input_ids=ids).logits
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama-gqa-bias-untied-llama3rope", "qwen2"])
def test_engine_forked_groups_on_gqa_models(name, monkeypatch):
    """Grouped-query attention decodes forked groups in the grouped layout too (a key/value
    head's query heads and samples in one matmul); tokens and log-probs equal the HF
    forward's."""
    import gyre.models.lean_decode as decode_mod

    model = _sharp(copy.deepcopy(MODELS[name]), seed=5)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 61, (n,), generator=g).tolist() for n in (9, 12)]
    reqs = [GenerationRequest(p, seed=10 * k + j) for k, p in enumerate(prompts) for j in range(3)]
    params = SamplingParams(1.0, 1.0, 20, ())  # past the group's first capacity (16 steps)
    reps = []
    real = decode_mod._Group.attend

    def attend(self, q, k, *a, **kw):
        reps.append(q.shape[1] // k.shape[1])
        return real(self, q, k, *a, **kw)

    monkeypatch.setattr(decode_mod._Group, "attend", attend)
    lean = TorchEngine(copy.deepcopy(model), 0).generate(reqs, params)
    assert reps and set(reps) == {2}  # 4 query heads on 2 key/value heads, grouped
    hf = TorchEngine(copy.deepcopy(model), 0, lean_forward=False).generate(reqs, params)
    for a, b in zip(lean, hf, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("shape", [(256, 1, 13), (32, 8, 5), (4, 1, 7), (128, 1, 24)])
def test_attention_softmax_padding_is_exact(shape):
    """lean_decode._softmax pads short score rows to 16 columns of -inf (torch's fast CPU path):
    the same probabilities as softmax, also with masked (dtype min) and fully masked rows."""
    from gyre.models.lean_decode import _softmax

    g = torch.Generator().manual_seed(0)
    s = torch.randn(*shape, generator=g) * 4
    s[..., -1] = torch.finfo(s.dtype).min  # a masked key
    s[0] = torch.finfo(s.dtype).min  # rows with every key masked
    got = _softmax(s)
    assert got.shape == s.shape
    torch.testing.assert_close(got, s.softmax(-1), atol=1e-6, rtol=1e-5)
    assert torch.all(got[1:, ..., -1] == 0)  # a masked key gets exactly 0 unless all are


def test_rope_table_follows_a_dtype_change():
    """A model moved to bf16 after a lean forward in fp32 (found by bench/gpu_check.py): the
    cached RoPE table must follow the dtype, or attention sees fp32 and bf16 operands."""
    model = copy.deepcopy(MODELS["llama-tied"])
    lean = lean_for(model)
    assert lean is not None
    ids = torch.randint(0, SMALL["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6)[None].expand(2, 6)
    am = torch.ones(2, 6, dtype=torch.long)
    with torch.no_grad():
        lean.logits(lean.hidden(ids, pos, lean.padded_mask(am, torch.float32)))
        model.to(torch.bfloat16)
        got = lean.logits(lean.hidden(ids, pos, lean.padded_mask(am, torch.bfloat16)))
        ref = model(input_ids=ids, attention_mask=am).logits
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)
