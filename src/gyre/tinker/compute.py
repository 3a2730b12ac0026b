"""The work behind the futures: forward/backward, the optimizer step, sampling.

Each function takes a tenant (or a module to sample from) and plain arrays, and returns plain
arrays; :mod:`gyre.tinker.service` runs them one at a time on its worker thread.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gyre.engines.torch_engine import TorchEngine
from gyre.rollout.stops import cut_at_stop
from gyre.tinker.errors import Unsupported, UserError
from gyre.tinker.losses import get_loss
from gyre.tinker.tenants import Tenant
from gyre.tinker.wire import FwdBwdCall, SampledSeq
from gyre.types import GenerationRequest, SamplingParams


def _targets(call: FwdBwdCall, vocab: int) -> list[torch.Tensor]:
    out = []
    for i, d in enumerate(call.data):
        where = f"data[{i}]"
        if not d.tokens:
            raise UserError(f"{where}.model_input: empty")
        if "target_tokens" not in d.inputs:
            raise UserError(f"{where}.loss_fn_inputs.target_tokens: required")
        t = torch.from_numpy(np.array(d.inputs["target_tokens"], dtype=np.int64))
        if t.dim() not in (1, 2) or t.shape[0] != len(d.tokens):
            raise UserError(
                f"{where}.loss_fn_inputs.target_tokens: shape {list(t.shape)}, need "
                f"[{len(d.tokens)}] or [{len(d.tokens)}, K] (one row per input token)"
            )
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
            raise UserError(f"{where}.loss_fn_inputs.target_tokens: ids must be in [0, {vocab})")
        if max(d.tokens) >= vocab or min(d.tokens) < 0:
            raise UserError(f"{where}.model_input: token ids must be in [0, {vocab})")
        out.append(t)
    return out


def _chunks(lengths: list[int], budget: int) -> list[range]:
    """Consecutive datum ranges whose padded size (rows x longest) stays within ``budget``
    tokens (a datum longer than the budget is a chunk of its own)."""
    out, start, longest = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i - start + 1) * max(longest, n) > budget:
            out.append(range(start, i))
            start, longest = i, 0
        longest = max(longest, n)
    out.append(range(start, len(lengths)))
    return out


def forward_backward(
    tenant: Tenant, call: FwdBwdCall, device: torch.device, pad_id: int, budget: int
) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
    """Score every datum's targets, apply ``call.loss_fn`` per datum, and (unless
    ``forward_only``) add the gradient of the summed loss to the tenant's parameters.

    Datums run in micro-batches of at most ``budget`` padded tokens (the (B, T, V) log-probs of
    a large vocabulary are the memory peak); gradients add up across them, as the losses are
    sums. A micro-batch with a non-finite loss fails the request after the earlier ones of the
    same call have added their gradients."""
    loss_fn = get_loss(call.loss_fn)
    if not call.data:
        raise UserError("data: empty")
    model = tenant.activate()
    vocab = int(model.get_output_embeddings().weight.shape[0])
    targets = _targets(call, vocab)
    for i, d in enumerate(call.data):
        for k, v in d.inputs.items():
            if k != "target_tokens" and not np.all(np.isfinite(v)):
                raise UserError(f"data[{i}].loss_fn_inputs.{k}: holds NaN or inf")
    lengths = [len(d.tokens) for d in call.data]
    outputs: list[dict[str, np.ndarray]] = []
    total = 0.0
    for rows in _chunks(lengths, budget):
        ids = torch.full((len(rows), max(lengths[i] for i in rows)), pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            ids[r, : lengths[i]] = torch.tensor(call.data[i].tokens)
            attn[r, : lengths[i]] = 1
        with torch.set_grad_enabled(not call.forward_only):
            logits = model(input_ids=ids.to(device), attention_mask=attn.to(device)).logits
            logp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
            part = logp.new_zeros(())
            for r, i in enumerate(rows):
                loss, out = _datum_loss(loss_fn, logp[r, : lengths[i]], targets[i], call, i)
                part = part + loss
                outputs.append(out)
            if not torch.isfinite(part):
                raise UserError(f"loss is {part.item()} (non-finite); check loss_fn_inputs")
            if not call.forward_only:
                part.backward()
        total += float(part.item())
    return outputs, {"loss:sum": total}


def _datum_loss(
    loss_fn: Any, logp: torch.Tensor, target: torch.Tensor, call: FwdBwdCall, i: int
) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """Datum ``i``'s loss from its (T, V) log-probs, and its outputs for the response."""
    n = logp.shape[0]
    target = target.to(logp.device)
    lp = logp.gather(-1, target.view(n, -1)).view(target.shape)
    inputs = {
        k: torch.tensor(np.asarray(v, dtype=np.float32), device=logp.device)
        for k, v in call.data[i].inputs.items()
        if k != "target_tokens"
    }
    try:
        loss, per_token = loss_fn(lp, inputs, call.loss_fn_config)
    except UserError as exc:
        raise type(exc)(f"data[{i}].{exc.message}") from None
    out = {
        "logprobs": lp.detach().cpu().numpy(),
        "elementwise_loss": per_token.detach().cpu().numpy(),
    }
    return loss, out


def optim_step(tenant: Tenant, adam: dict[str, float]) -> dict[str, float]:
    """One AdamW step (decoupled weight decay) with this call's hyperparameters."""
    lr, wd = float(adam["learning_rate"]), float(adam["weight_decay"])
    betas, eps = (float(adam["beta1"]), float(adam["beta2"])), float(adam["eps"])
    if tenant.optimizer is None:
        tenant.optimizer = torch.optim.AdamW(
            tenant.params, lr=lr, betas=betas, eps=eps, weight_decay=wd
        )
    for group in tenant.optimizer.param_groups:
        group.update(lr=lr, betas=betas, eps=eps, weight_decay=wd)
    grads = [p for p in tenant.params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in grads]) if grads else torch.zeros(())
    clip = float(adam.get("grad_clip_norm", 0.0))
    if clip > 0 and grads:
        torch.nn.utils.clip_grads_with_norm_(grads, clip, norm)
    tenant.optimizer.step()
    tenant.optimizer.zero_grad(set_to_none=True)
    tenant.steps += 1
    return {"grad_norm:mean": float(norm)}


def _stops(stop: Any, eos: int | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """SamplingParams.stop: None -> EOS, [] -> nothing, ints -> tokens, strings -> texts."""
    if stop is None:
        return ((eos,) if eos is not None else ()), ()
    if isinstance(stop, str):
        return (), (stop,)
    stop = list(stop)
    if all(isinstance(s, int) for s in stop):
        return tuple(stop), ()
    if all(isinstance(s, str) for s in stop):
        return (), tuple(stop)
    raise UserError("sampling_params.stop: a string, a list of strings or a list of token ids")


@dataclass(frozen=True)
class SampleJob:
    """One validated ``asample`` request. Jobs with equal ``params`` (and the same weights)
    run as one engine batch."""

    prompt: tuple[int, ...]
    n: int
    seed: int
    prompt_logprobs: bool
    params: SamplingParams
    stop_texts: tuple[str, ...]


def check_sample(
    request: dict[str, Any], tokenizer: Any, vocab: int, seed: int, max_context: int
) -> SampleJob:
    """Validate an ``asample`` body before it is queued; errors name the field."""
    prompt, params = request["prompt_ids"], request["sampling_params"]
    if params.get("top_k", -1) not in (-1, 0, None):
        raise Unsupported("sampling_params.top_k: only -1 (no top-k) is supported")
    for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if request.get(key):
            raise Unsupported(f"{key}: not supported by this server")
    if request.get("target_prompt_logprobs") is not None:
        raise Unsupported("target_prompt_logprobs: not supported by this server")
    if max(prompt) >= vocab:
        raise UserError(f"prompt: token ids must be in [0, {vocab})")
    room = max_context - len(prompt)
    max_tokens = params.get("max_tokens")
    max_tokens = min(128, room) if max_tokens is None else int(max_tokens)
    if max_tokens < 1 or max_tokens > room:
        raise UserError(
            f"sampling_params.max_tokens: {max_tokens} with a {len(prompt)}-token prompt "
            f"exceeds max_context {max_context}"
        )
    temperature, top_p = float(params.get("temperature", 1.0)), float(params.get("top_p", 1.0))
    if temperature < 0 or not 0 < top_p <= 1:
        raise UserError("sampling_params: need temperature >= 0 and 0 < top_p <= 1")
    stop_ids, stop_texts = _stops(params.get("stop"), tokenizer.eos_token_id)
    sp = SamplingParams(
        temperature=temperature, top_p=top_p, max_new_tokens=max_tokens, stop_token_ids=stop_ids
    )
    seed = seed if params.get("seed") is None else int(params["seed"])
    return SampleJob(
        tuple(prompt), request["n"], seed, bool(request.get("prompt_logprobs")), sp, stop_texts
    )


def sample_batch(
    module: torch.nn.Module,
    context: contextlib.AbstractContextManager,
    tokenizer: Any,
    jobs: list[SampleJob],
    max_rows: int,
) -> list[tuple[list[SampledSeq], np.ndarray | None]]:
    """Every job's ``n`` completions in one batch of gyre's engine (the jobs share
    ``params``), and each job's prompt logprobs (NaN at position 0) when asked. Sample i of a
    job draws from the stream keyed by (job seed + i), whatever else shares the batch; at most
    ``max_rows`` sequences decode at once (continuous batching admits the rest as rows finish)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with context, torch.no_grad():
        lean = not hasattr(module, "peft_config")
        engine = TorchEngine(
            module, pad, seed=jobs[0].seed, max_batch_size=max_rows, lean_forward=lean
        )
        reqs = [
            GenerationRequest(list(j.prompt), seed=j.seed + i) for j in jobs for i in range(j.n)
        ]
        comps = iter(engine.generate(reqs, jobs[0].params))
        prompt_lps = [
            _prompt_logprobs(module, j.prompt) if j.prompt_logprobs else None for j in jobs
        ]
    out = []
    for job, prompt_lp in zip(jobs, prompt_lps, strict=True):
        seqs = []
        for _ in range(job.n):
            c = next(comps)
            tokens, lps, stopped = list(c.token_ids), list(c.logprobs), c.finish_reason == "stop"
            cut = cut_at_stop(tokens, job.stop_texts, lambda t: tokenizer.decode(list(t)))
            if cut is not None:
                tokens, lps, stopped = tokens[:cut], lps[:cut], True
            seqs.append(SampledSeq(tokens, lps, stopped))
        out.append((seqs, prompt_lp))
    return out


def _prompt_logprobs(module: torch.nn.Module, prompt: tuple[int, ...]) -> np.ndarray:
    device = next(module.parameters()).device
    ids = torch.tensor([prompt], device=device)
    logp = torch.log_softmax(module(input_ids=ids).logits.float()[0], dim=-1)  # (P, V)
    out = np.full(len(prompt), np.nan, dtype=np.float32)
    if len(prompt) > 1:
        got = logp[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        out[1:] = got.cpu().numpy()
    return out
