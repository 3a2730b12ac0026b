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
from gyre.tinker.custom_loss import CustomLoss
from gyre.tinker.errors import UserError
from gyre.tinker.losses import get_loss
from gyre.tinker.prompt_scores import (
    MAX_TOPK,
    PromptAsk,
    PromptScores,
    check_alt_k,
    parse_targets,
    score_prompt,
)
from gyre.tinker.tenants import Tenant
from gyre.tinker.wire import MASK_LOGPROB, FwdBwdCall, SampledSeq
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


class CustomRun:
    """A ``create_custom_loss`` graph as a per-datum loss: checks each datum's inputs against
    the declared ranks, and adds up the metrics (``:sum`` summed, ``:mean`` averaged)."""

    def __init__(self, loss: CustomLoss, n_data: int) -> None:
        self.loss, self.n_data, self.sums = loss, n_data, {}

    def __call__(self, lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict):
        for name, rank in self.loss.inputs:
            value = lp if name == "logprobs" else inputs.get(name)
            key = "target_tokens" if name == "logprobs" else name
            if value is None:
                raise UserError(f"loss_fn_inputs.{key}: required by custom loss {self.loss.name!r}")
            if rank == 0 and value.numel() == 1:
                inputs[name] = value = value.reshape(())
            if value.dim() != rank:
                raise UserError(
                    f"loss_fn_inputs.{key}: rank {value.dim()}, custom loss "
                    f"{self.loss.name!r} declared {name} with rank {rank}"
                )
        loss, metrics = self.loss(lp, inputs)
        for key, value in metrics.items():
            v = float(value.detach().sum()) if isinstance(value, torch.Tensor) else float(value)
            self.sums[key] = self.sums.get(key, 0.0) + v
        return loss, None

    def metrics(self) -> dict[str, float]:
        return {k: v / self.n_data if k.endswith(":mean") else v for k, v in self.sums.items()}


def forward_backward(
    tenant: Tenant,
    call: FwdBwdCall,
    device: torch.device,
    pad_id: int,
    budget: int,
    custom: CustomLoss | None = None,
) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
    """Score every datum's targets, apply ``call.loss_fn`` (or the uploaded ``custom`` loss)
    per datum, and (unless ``forward_only``) add the gradient of the summed loss to the
    tenant's parameters.

    Datums run in micro-batches of at most ``budget`` padded tokens (the (B, T, V) log-probs of
    a large vocabulary are the memory peak), shortest first so that rows of like length share
    one; gradients add up across them, as the losses are sums. Rows are right-padded and run
    without an attention mask: in a causal model no real position sees the padding after it,
    and plain causal attention is a faster kernel than a masked one. A micro-batch with a
    non-finite loss fails the request after the earlier ones of the same call have added
    their gradients."""
    loss_fn = get_loss(call.loss_fn) if custom is None else CustomRun(custom, len(call.data))
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
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    outputs: list[dict[str, np.ndarray]] = [{} for _ in lengths]
    total = 0.0
    for span in _chunks([lengths[i] for i in order], budget):
        rows = [order[j] for j in span]
        ids = torch.full((len(rows), max(lengths[i] for i in rows)), pad_id, dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, : lengths[i]] = torch.tensor(call.data[i].tokens)
        with torch.set_grad_enabled(not call.forward_only):
            logits = model(input_ids=ids.to(device)).logits
            logp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
            part = logp.new_zeros(())
            for r, i in enumerate(rows):
                loss, outputs[i] = _datum_loss(loss_fn, logp[r, : lengths[i]], targets[i], call, i)
                part = part + loss
            if not torch.isfinite(part):
                raise UserError(f"loss is {part.item()} (non-finite); check loss_fn_inputs")
            if not call.forward_only:
                part.backward()
        total += float(part.item())
    extra = loss_fn.metrics() if isinstance(loss_fn, CustomRun) else {}
    return outputs, {**extra, "loss:sum": total}


def _datum_loss(
    loss_fn: Any, logp: torch.Tensor, target: torch.Tensor, call: FwdBwdCall, i: int
) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """Datum ``i``'s loss from its (T, V) log-probs, and its outputs for the response."""
    n = logp.shape[0]
    target = target.to(logp.device)
    lp = logp.gather(-1, target.view(n, -1)).view(target.shape)
    # A custom loss may read integer inputs (indices); the built-in losses read floats.
    keep_ints = isinstance(loss_fn, CustomRun)
    inputs = {
        k: torch.from_numpy(
            np.array(v, dtype=np.int64 if keep_ints and v.dtype.kind in "iu" else np.float32)
        ).to(logp.device)
        for k, v in call.data[i].inputs.items()
        if k != "target_tokens"
    }
    try:
        loss, per_token = loss_fn(lp, inputs, call.loss_fn_config)
    except UserError as exc:
        raise type(exc)(f"data[{i}].{exc.message}") from None
    out = {"logprobs": lp.detach().cpu().numpy()}
    if per_token is not None:
        out["elementwise_loss"] = per_token.detach().cpu().numpy()
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
    params: SamplingParams
    stop_texts: tuple[str, ...]
    ask: PromptAsk  # what to score on the prompt


def check_sample(
    request: dict[str, Any], tokenizer: Any, vocab: int, seed: int, max_context: int
) -> SampleJob:
    """Validate an ``asample`` body before it is queued; errors name the field."""
    prompt, params = request["prompt_ids"], request["sampling_params"]
    top_k = params.get("top_k")
    top_k = -1 if top_k is None else top_k
    if not isinstance(top_k, int) or top_k < -1:
        raise UserError(f"sampling_params.top_k: -1 (off) or a positive integer, got {top_k!r}")
    targets = parse_targets(request.get("target_prompt_logprobs"), len(prompt), vocab)
    alt_k = check_alt_k(request.get("prompt_alt_tokens_k"))
    topk_prompt, topk_sample = (
        _topk(request, key, vocab) for key in ("topk_prompt_logprobs", "topk_sample_logprobs")
    )
    last_n = request.get("prompt_logprobs_last_n")
    if last_n is not None and (not isinstance(last_n, int) or not 1 <= last_n < len(prompt)):
        raise UserError(
            f"prompt_logprobs_last_n: must be in [1, {len(prompt) - 1}] (len(prompt) - 1), "
            f"got {last_n!r}"
        )
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
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        max_new_tokens=max_tokens,
        stop_token_ids=stop_ids,
        top_logprobs=topk_sample,
    )
    seed = seed if params.get("seed") is None else int(params["seed"])
    ask = PromptAsk(
        bool(request.get("prompt_logprobs")), topk_prompt, last_n, targets, alt_k, temperature
    )
    return SampleJob(tuple(prompt), request["n"], seed, sp, stop_texts, ask)


def _topk(request: dict[str, Any], key: str, vocab: int) -> int:
    k = request.get(key) or 0
    if not isinstance(k, int) or not 0 <= k <= min(vocab, MAX_TOPK):
        raise UserError(f"{key}: must be an integer in [0, {min(vocab, MAX_TOPK)}], got {k!r}")
    return k


def sample_batch(
    module: torch.nn.Module,
    context: contextlib.AbstractContextManager,
    tokenizer: Any,
    jobs: list[SampleJob],
    max_rows: int,
) -> list[tuple[list[SampledSeq], PromptScores]]:
    """Every job's ``n`` completions in one batch of gyre's engine (the jobs share
    ``params``), and each job's prompt scores when asked (:func:`score_prompt`). Sample i of a
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
        scored = [
            score_prompt(module, j.prompt, j.ask, j.seed) if j.ask.any else PromptScores()
            for j in jobs
        ]
    out = []
    k = jobs[0].params.top_logprobs
    for job, prompt_scores in zip(jobs, scored, strict=True):
        seqs = []
        for _ in range(job.n):
            c = next(comps)
            tokens, lps, stopped = list(c.token_ids), list(c.logprobs), c.finish_reason == "stop"
            cut = cut_at_stop(tokens, job.stop_texts, lambda t: tokenizer.decode(list(t)))
            if cut is not None:
                tokens, lps, stopped = tokens[:cut], lps[:cut], True
            top = _topk_rows(c.top_logprobs[: len(tokens)], k) if k else None
            seqs.append(SampledSeq(tokens, lps, stopped, top))
        out.append((seqs, prompt_scores))
    return out


def _topk_rows(rows: list[dict[int, float]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The engine's per-token {id: logprob} as (N, k) id and logprob matrices, best first."""
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), MASK_LOGPROB, dtype=np.float32)
    for r, row in enumerate(rows):
        best = sorted(row.items(), key=lambda kv: -kv[1])[:k]
        ids[r, : len(best)] = [t for t, _ in best]
        lps[r, : len(best)] = [v for _, v in best]
    return ids, lps
