"""Performance sections of ``bench/gpu_check.py``: matmul peak, rollout throughput, GRPO step
time and the model-size ladder. Every model is built from its config with random weights (no
download); the shapes are those of the public Qwen2.5 checkpoints' ``config.json``.

FLOPs (stated in the report as ``flops_formula``): with N = parameters that take part in matmuls
(every parameter but the input embedding table; a tied table counts once, as the LM head), L
layers and d = heads x head_dim, one token at 0-based position t costs ``2N + 4 L d (t + 1)``
forward (the matmuls plus QK^T and AV over its t + 1 keys); training costs 3x forward
(forward + backward). Work counted is the useful work: each distinct prompt once (a group of G
samples shares its prompt), each sampled row's own tokens once. MFU = counted FLOPs / seconds /
the measured dense matmul rate of the same device (bf16, and fp32 for fp32 work).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import rollout as rb  # bench/rollout.py (gpu_check.py puts bench/ on sys.path)
from gyre.algos import grpo_advantages
from gyre.config import TrainConfig
from gyre.engines import TorchEngine
from gyre.trainer import scoring
from gyre.trainer.batch import collate
from gyre.trainer.update import policy_update as grpo_update
from gyre.types import GenerationRequest, SamplingParams, Trajectory

FLOPS_FORMULA = (
    "forward per token at position t: 2N + 4*L*d*(t+1), N = params minus the input embedding "
    "(tied: counted once as the head), d = heads*head_dim; training = 3x forward; each distinct "
    "prompt counted once per group, each row's sampled tokens once"
)
QWEN25 = {  # the public Qwen2.5 config.json shapes
    "0.5b": dict(h=896, i=4864, L=24, heads=14, kv=2, vocab=151936, tied=True),
    "1.5b": dict(h=1536, i=8960, L=28, heads=12, kv=2, vocab=151936, tied=True),
    "3b": dict(h=2048, i=11008, L=36, heads=16, kv=2, vocab=151936, tied=True),
    "7b": dict(h=3584, i=18944, L=28, heads=28, kv=4, vocab=152064, tied=False),
    "14b": dict(h=5120, i=13824, L=48, heads=40, kv=8, vocab=152064, tied=False),
}
TINY = {  # smoke-mode stand-ins
    "tiny-a": dict(h=64, i=128, L=2, heads=4, kv=2, vocab=512, tied=True),
    "tiny-b": dict(h=96, i=192, L=3, heads=4, kv=2, vocab=512, tied=False),
}
SHAPES = {**QWEN25, **TINY}
PAD, EOS = 0, 1


def qwen2_config(shape: str | dict, vocab: int | None = None) -> Qwen2Config:
    s = SHAPES[shape] if isinstance(shape, str) else shape
    return Qwen2Config(
        vocab_size=vocab or s["vocab"],
        hidden_size=s["h"],
        intermediate_size=s["i"],
        num_hidden_layers=s["L"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        tie_word_embeddings=s["tied"],
        max_position_embeddings=4096,
        rope_theta=1e6,
        use_sliding_window=False,
        pad_token_id=PAD,
        bos_token_id=EOS,
        eos_token_id=EOS,
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build(cfg: Qwen2Config, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A randomly initialised Qwen2 built directly on ``device`` in ``dtype``."""
    torch.manual_seed(seed)
    with _default_dtype(dtype), torch.device(device):
        return Qwen2ForCausalLM(cfg)


# -- counting ---------------------------------------------------------------------------------
@dataclass
class FlopModel:
    n: int  # matmul parameters
    layers: int
    d_attn: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> FlopModel:
        cfg = model.config
        total = sum(p.numel() for p in model.parameters())
        emb = model.get_input_embeddings().weight
        tied = model.get_output_embeddings().weight is emb
        n = total if tied else total - emb.numel()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(n, cfg.num_hidden_layers, cfg.num_attention_heads * head_dim)

    def forward(self, start: int, end: int) -> float:
        """Forward FLOPs of the tokens at positions start..end-1 of one sequence."""
        k = end - start
        ctx = end * (end + 1) / 2 - start * (start + 1) / 2  # sum of (t + 1)
        return 2.0 * self.n * k + 4.0 * self.layers * self.d_attn * ctx

    def rollout(self, prompt_lens: Sequence[int], group: int, new: int) -> float:
        """Prefill each prompt once, then ``new - 1`` decode steps per row (the last sampled
        token is never fed back)."""
        return sum(self.forward(0, p) + group * self.forward(p, p + new - 1) for p in prompt_lens)

    def train(self, prompt_lens: Sequence[int], group: int, new: int) -> float:
        return 3.0 * sum(self.forward(0, p) + group * self.forward(p, p + new) for p in prompt_lens)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits (small CPU rates must not round to 0)."""
    return float(f"{x:.{digits}g}")


def _mfu(flops: float, seconds: float, peaks: dict[str, float], dtype: torch.dtype) -> dict:
    out: dict[str, Any] = {"tflops": _sig(flops / seconds / 1e12)}
    for name in ("bfloat16", "float32"):
        rate = peaks.get(name)
        if rate and (name == "bfloat16" or dtype == torch.float32):
            out[f"mfu_vs_{name}"] = _sig(flops / seconds / (rate * 1e12), 3)
    return out


# -- sections ---------------------------------------------------------------------------------
def matmul_peak(device: torch.device, n: int, iters: int) -> dict[str, Any]:
    """Dense ``n x n @ n x n`` rate in TFLOP/s (mean of ``iters`` products after 3 warm-ups)."""
    out: dict[str, Any] = {
        "n": n,
        "iters": iters,
        "fp32_precision": torch.get_float32_matmul_precision(),
    }
    for dtype in (torch.bfloat16, torch.float32):
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
        for _ in range(3):
            torch.matmul(a, b)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a, b)
        _sync(device)
        dt = time.perf_counter() - t0
        out[str(dtype).removeprefix("torch.")] = _sig(2.0 * n**3 * iters / dt / 1e12)
        del a, b
    return out


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def hf_generate(model: Any, prompts: list[list[int]], group: int, new: int) -> float:
    """HF ``generate`` on the left-padded prompts, ``group`` samples each, exactly ``new``
    tokens per row (``min_new_tokens``); returns seconds."""
    device = next(model.parameters()).device
    ids, mask = rb.left_pad(prompts, PAD)
    cfg = rb.hf_config(SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS), new, None, group)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=cfg
        )
    _sync(device)
    dt = time.perf_counter() - t0
    assert out.shape == (len(prompts) * group, ids.shape[1] + new), tuple(out.shape)
    return dt


def rollout_throughput(ctx: Any) -> dict[str, Any]:
    """gyre ``TorchEngine`` vs HF ``generate``: G samples of P random prompts, ``new`` tokens."""
    sz, dev = ctx.sizes, ctx.device
    dtype = torch.bfloat16
    model = build(qwen2_config(sz.perf_shape), dev, dtype).eval()
    fm = FlopModel.of(model)
    engine = TorchEngine(model, pad_token_id=PAD, seed=0)
    vocab = model.config.vocab_size
    warm = random_prompts(2, 8, 16, vocab, 99)
    rb.single_turn_gyre(engine, warm, 2, 4)
    hf_generate(model, warm, 2, 4)
    out: dict[str, Any] = {
        "model": sz.perf_shape,
        "params": sum(p.numel() for p in model.parameters()),
        "flop_params": fm.n,
        "dtype": "bfloat16",
        "group_size": sz.group,
        "new_tokens": sz.new_tokens,
        "prompt_len": [sz.prompt_lo, sz.prompt_hi],
        "points": [],
    }
    for n_prompts in sz.prompt_batches:
        if not ctx.budget.allows(sz.throughput_need_s * n_prompts / max(sz.prompt_batches)):
            out["points"].append({"prompts": n_prompts, "skipped": ctx.budget.note()})
            continue
        prompts = random_prompts(n_prompts, sz.prompt_lo, sz.prompt_hi, vocab, n_prompts)
        flops = fm.rollout([len(p) for p in prompts], sz.group, sz.new_tokens)
        point: dict[str, Any] = {"prompts": n_prompts, "rows": n_prompts * sz.group}
        tokens = n_prompts * sz.group * sz.new_tokens
        for side in ("gyre", "hf"):
            free_memory(dev)
            _reset_peak(dev)
            if side == "gyre":
                dt = rb.single_turn_gyre(engine, prompts, sz.group, sz.new_tokens).seconds
            else:
                dt = hf_generate(model, prompts, sz.group, sz.new_tokens)
            point[side] = {
                "seconds": round(dt, 3),
                "tok_s": round(tokens / dt, 1),
                "peak_gib": _peak_gib(dev),
                **_mfu(flops, dt, ctx.peaks, dtype),
            }
        point["gyre_over_hf"] = round(point["gyre"]["tok_s"] / point["hf"]["tok_s"], 3)
        out["points"].append(point)
    del engine, model
    free_memory(dev)
    return out


def _rollout_trajs(
    engine: TorchEngine, prompts: list[list[int]], group: int, new: int, seed: int
) -> tuple[list[Trajectory], torch.Tensor]:
    """One GRPO batch: the engine's samples as trajectories, random 0/1 rewards, advantages."""
    reqs = [GenerationRequest(p) for p in prompts for _ in range(group)]
    params = SamplingParams(1.0, 1.0, new, (), seed=seed)
    outs = engine.generate(reqs, params)
    engine.release([None])
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (len(reqs),), generator=g).float()
    trajs = []
    for i, (req, o) in enumerate(zip(reqs, outs, strict=True)):
        p = len(req.prompt_ids)
        trajs.append(
            Trajectory(
                [*req.prompt_ids, *o.token_ids],
                [0] * p + [1] * len(o.token_ids),
                [0.0] * p + list(o.logprobs),
                float(rewards[i]),
                i // group,
                0,
                1,
                bool(rewards[i]),
                i // group,
            )
        )
    gids = torch.tensor([t.group_id for t in trajs])
    return trajs, grpo_advantages(rewards, gids)


def _update_settings(micro: int) -> TrainConfig:
    """One optimizer step per batch on the engine's log-probs (the old GRPOSettings defaults)."""
    return TrainConfig.model_validate(
        {"mini_batches": 1, "micro_batch_size": micro, "loss_agg": "seq-mean-token-mean",
         "algo": {"old_logprobs": "rollout"}}
    )  # fmt: skip


def grpo_step(ctx: Any) -> dict[str, Any]:
    """One gyre GRPO step on the perf model in fp32 (gyre trains in fp32): engine rollout of
    P x G rows, GRPO advantages of random rewards, one AdamW update. A first smaller step warms
    up (CUDA kernels, AdamW state); the second is timed."""
    sz, dev = ctx.sizes, ctx.device
    model = build(qwen2_config(sz.perf_shape), dev, torch.float32)
    fm = FlopModel.of(model)
    engine = TorchEngine(model, pad_token_id=PAD, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    vocab = model.config.vocab_size
    settings = _update_settings(sz.step_micro)
    warm, adv = _rollout_trajs(engine, random_prompts(2, 8, 16, vocab, 5), 2, 8, 5)
    grpo_update(model, opt, collate(warm, PAD, dev), adv.to(dev), settings)
    prompts = random_prompts(sz.step_prompts, sz.prompt_lo, sz.prompt_hi, vocab, 7)
    free_memory(dev)
    _reset_peak(dev)
    _sync(dev)
    t0 = time.perf_counter()
    trajs, adv = _rollout_trajs(engine, prompts, sz.group, sz.new_tokens, 7)
    t1 = time.perf_counter()
    stats = grpo_update(model, opt, collate(trajs, PAD, dev), adv.to(dev), settings)
    _sync(dev)
    t2 = time.perf_counter()
    lens = [len(p) for p in prompts]
    roll_f = fm.rollout(lens, sz.group, sz.new_tokens)
    train_f = fm.train(lens, sz.group, sz.new_tokens)
    out = {
        "model": sz.perf_shape,
        "dtype": "float32",
        "prompts": sz.step_prompts,
        "rows": len(trajs),
        "new_tokens": sz.new_tokens,
        "micro_batch_size": sz.step_micro,
        "rollout_s": round(t1 - t0, 3),
        "update_s": round(t2 - t1, 3),
        "step_s": round(t2 - t0, 3),
        "peak_gib": _peak_gib(dev),
        "rollout": _mfu(roll_f, t1 - t0, ctx.peaks, torch.float32),
        "update": _mfu(train_f, t2 - t1, ctx.peaks, torch.float32),
        "loss": stats.get("train/loss"),
        "trl": _trl_status(),
    }
    del engine, model, opt
    free_memory(dev)
    return out


def _trl_status() -> dict[str, Any]:
    """TRL's GRPOTrainer side: this check does not drive TRL; bench/vs_trl.py does (CPU)."""
    try:
        import trl
    except Exception as e:
        return {"skipped": f"trl not importable: {type(e).__name__}: {e}"}
    return {
        "skipped": f"trl {trl.__version__} importable, but this check does not run TRL on the "
        "device; bench/vs_trl.py is the side-by-side comparison"
    }


def _train_rung(ctx: Any, shape: str, checkpointing: bool) -> dict[str, Any]:
    """One GRPO update (forward + backward + AdamW) of a randomly initialised ``shape`` in fp32
    on synthetic rollouts; OOM is caught and recorded."""
    sz, dev = ctx.sizes, ctx.device
    model = opt = batch = None
    rec: dict[str, Any] = {"model": shape, "checkpointing": checkpointing}
    opts = scoring.ScoringOptions()
    t0 = time.perf_counter()
    try:
        model = build(qwen2_config(shape), dev, torch.float32)
        rec["params"] = sum(p.numel() for p in model.parameters())
        fm = FlopModel.of(model)
        if checkpointing:  # HF checkpointing acts on the HF layers: score through the HF forward
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:  # transformers >= 5.2x; gradient_checkpointing_enable before
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
            opts = scoring.ScoringOptions(lean=False, share_prefix=False)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        g = torch.Generator().manual_seed(0)
        vocab, P, n, G = model.config.vocab_size, sz.scale_prompt, sz.scale_new, sz.group
        trajs = []
        for k in range(sz.scale_tasks):
            prompt = torch.randint(2, vocab, (P,), generator=g).tolist()
            for _ in range(G):
                resp = torch.randint(2, vocab, (n,), generator=g).tolist()
                lp = (-torch.rand(n, generator=g) * 5).tolist()
                trajs.append(
                    Trajectory(
                        prompt + resp, [0] * P + [1] * n, [0.0] * P + lp, 0.0, k, 0, 1, False, k
                    )
                )
        adv = torch.randn(len(trajs), generator=g).to(dev)
        batch = collate(trajs, PAD, dev)
        free_memory(dev)
        _reset_peak(dev)
        _sync(dev)
        t1 = time.perf_counter()
        grpo_update(model, opt, batch, adv, _update_settings(sz.scale_micro), scoring=opts)
        _sync(dev)
        dt = time.perf_counter() - t1
        rec.update(
            status="ok",
            step_s=round(dt, 3),
            peak_gib=_peak_gib(dev),
            rows=len(trajs),
            tokens=len(trajs) * (P + n),
            **_mfu(fm.train([P] * sz.scale_tasks, G, n), dt, ctx.peaks, torch.float32),
        )
    except torch.OutOfMemoryError as e:
        rec.update(status="oom", error=str(e).splitlines()[0][:300], peak_gib=_peak_gib(dev))
    except Exception as e:
        rec.update(status="error", error=f"{type(e).__name__}: {e}"[:500])
    finally:
        del model, opt, batch
        free_memory(dev)
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    return rec


def scale_ladder(ctx: Any) -> dict[str, Any]:
    """Ascend the ladder without and with activation checkpointing; stop a mode at its first
    failure (a larger model fails too)."""
    sz = ctx.sizes
    out: dict[str, Any] = {
        "dtype": "float32 weights, AdamW",
        "batch": f"{sz.scale_tasks} task(s) x G={sz.group}, prompt {sz.scale_prompt} + "
        f"response {sz.scale_new} tokens, micro-batch {sz.scale_micro}",
        "modes": {},
        "largest": {},
    }
    for mode, ckpt in (("lean_no_ckpt", False), ("hf_grad_ckpt", True)):
        rungs: list[dict[str, Any]] = []
        for shape in sz.ladder:
            if rungs and rungs[-1].get("status") in ("oom", "error"):
                rungs.append({"model": shape, "status": "not tried: a smaller model failed"})
                continue
            if not ctx.budget.allows(sz.rung_need_s):
                rungs.append({"model": shape, "status": "skipped", "note": ctx.budget.note()})
                continue
            rungs.append(_train_rung(ctx, shape, ckpt))
        ok = [r["model"] for r in rungs if r.get("status") == "ok"]
        out["modes"][mode] = rungs
        out["largest"][mode] = ok[-1] if ok else None
    return out
