"""Sync verification: after a weight or adapter sync, prove each engine serves the trainer's policy.

An acknowledged sync is not an applied one: a server can answer ``{"success": true}`` and keep
the old weights, or list an adapter and sample the base model. So after every
``engine.verify_every``-th sync, a fixed probe sequence (``engine.verify_tokens`` token ids drawn
once from the vocabulary with the run's seed) is scored by each engine through its *prompt
log-probs* and by the trainer's model; the gap is the mean absolute difference per token, in
nats:

- vLLM: ``POST /v1/completions`` with ``prompt_logprobs: 0`` (``choices[0].prompt_logprobs``: a
  list of ``{token_id: {"logprob": ...}}``, ``None`` first), ``model`` = the served adapter;
- SGLang: ``POST /generate`` with ``return_logprob`` and ``logprob_start_len: 0``
  (``meta_info.input_token_logprobs``: ``[[logprob, id, text], ...]``, ``None`` first),
  ``lora_path`` = the adapter;
- ``gyre serve`` answers both;
- the in-process engine: a forward of its model.

The check fails (exit 3, :class:`SyncNotApplied`) when an engine's gap to the new version is over
``engine.verify_tolerance``, or when it is over a tenth of it and the engine is at least twice as
close to the previously verified version (a sync that changed nothing, caught even when one step
moved the policy less than the tolerance). Log-probs are the model's own (temperature 1, no
top-p): what every server's prompt log-probs are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from gyre.checkpoint.resume import FaultAbort

PROBE_SEED_OFFSET = 0x5EED  # the probe's ids do not share a stream with anything else


class SyncNotApplied(FaultAbort):
    """An engine does not serve the policy it was synced to (exit 3)."""


def probe_ids(
    tokenizer: Any, vocab_size: int, n: int, seed: int, never: tuple[int, ...] = ()
) -> list[int]:
    """``n`` token ids drawn with ``seed`` from the vocabulary, special tokens (and ``never``:
    a VLM's image and video placeholders, which a text-only forward refuses) left out."""
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(never)
    pool = torch.tensor([i for i in range(vocab_size) if i not in special])
    g = torch.Generator().manual_seed(seed + PROBE_SEED_OFFSET)
    return pool[torch.randint(len(pool), (n,), generator=g)].tolist()


@dataclass
class PromptToken:
    """One prompt position after the first: its token's log-prob and rank, the ``k`` best."""

    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]


@torch.no_grad()
def prompt_table(model: torch.nn.Module, ids: list[int], k: int) -> list[PromptToken]:
    """Positions 1 .. n-1 of ``ids`` under ``model`` (one forward, float32 log-softmax)."""
    if len(ids) < 2:
        return []
    param = next(model.parameters())
    x = torch.tensor([ids], device=param.device)
    logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), dim=-1)  # (n-1, V)
    target = x[0, 1:, None].to(logp.device)
    lp = logp.gather(1, target)  # (n-1, 1)
    ranks = (logp > lp).sum(dim=1) + 1
    top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    return [
        PromptToken(
            float(lp[j, 0]),
            int(ranks[j]),
            list(zip(top_i[j].tolist(), top_v[j].tolist(), strict=True)),
        )
        for j in range(len(ids) - 1)
    ]


def model_prompt_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """log p(ids[k] | ids[:k]) for k = 1 .. n-1 under ``model`` (in eval mode, no autograd:
    an FSDP2 model's forward then reshards without waiting for a backward)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return [row.logprob for row in prompt_table(model, ids, 0)]
    finally:
        model.train(was_training)


# -- the protocols ------------------------------------------------------------------------------


def openai_probe_body(ids: list[int], model: str) -> dict[str, Any]:
    """vLLM's completions request for the prompt's log-probs (one token is generated: vLLM
    needs ``max_tokens >= 1``). Temperature 1 and top-p 1, so that a server reporting
    processed log-probs (vLLM's ``--logprobs-mode processed_logprobs``) reports raw ones."""
    return {
        "model": model,
        "prompt": list(ids),
        "max_tokens": 1,
        "temperature": 1.0,
        "top_p": 1.0,
        "prompt_logprobs": 0,
    }


def parse_openai_prompt_logprobs(data: dict[str, Any], ids: list[int]) -> list[float]:
    """``choices[0].prompt_logprobs`` -> the log-prob of each prompt token after the first."""
    entries = data["choices"][0].get("prompt_logprobs")
    if entries is None:
        raise ValueError("no choices[0].prompt_logprobs (the server ignores prompt_logprobs)")
    return _take(entries, ids, lambda e, t: float(_entry(e, t)["logprob"]))


def sglang_probe_body(ids: list[int], lora: str | None) -> dict[str, Any]:
    """SGLang's ``/generate`` request for the prompt's log-probs."""
    return {
        "input_ids": list(ids),
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "lora_path": lora,
    }


def parse_sglang_prompt_logprobs(data: dict[str, Any], ids: list[int]) -> list[float]:
    """``meta_info.input_token_logprobs`` ([[logprob, id, text], ...]) -> the prompt's."""
    entries = data["meta_info"].get("input_token_logprobs")
    if entries is None:
        raise ValueError("no meta_info.input_token_logprobs (send logprob_start_len=0)")

    def one(e: Any, t: int) -> float:
        if int(e[1]) != t:
            raise ValueError(f"input_token_logprobs names token {e[1]} where the probe has {t}")
        return float(e[0])

    return _take(entries, ids, one)


def _entry(e: dict[str, Any], token: int) -> dict[str, Any]:
    got = e.get(str(token), e.get(token))  # type: ignore[call-overload]
    if got is None:
        raise ValueError(f"prompt_logprobs has no entry for prompt token {token}")
    return got


def _take(entries: list[Any], ids: list[int], one: Any) -> list[float]:
    if len(entries) != len(ids):
        raise ValueError(f"{len(entries)} prompt log-probs for a prompt of {len(ids)} tokens")
    return [one(e, t) for e, t in zip(entries[1:], ids[1:], strict=True)]


# -- the check ----------------------------------------------------------------------------------


def engine_prompt_logprobs(engine: Any, ids: list[int]) -> dict[str, list[float]]:
    """Each engine's prompt log-probs of ``ids``: ``{name: [...]}`` (an HTTP engine: one entry
    per live server; the in-process engine: its model)."""
    if hasattr(engine, "prompt_logprobs_each"):
        return engine.prompt_logprobs_each(ids)
    return {"in-process engine": model_prompt_logprobs(engine.model, ids)}


def mean_gap(a: list[float], b: list[float]) -> float:
    return float(torch.tensor(a).sub(torch.tensor(b)).abs().mean())


def placeholder_ids(model: torch.nn.Module) -> tuple[int, ...]:
    """A VLM's image / video placeholder token ids (none for a text model)."""
    cfg = getattr(model, "config", None)
    keys = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
    return tuple(int(v) for k in keys if isinstance(v := getattr(cfg, k, None), int))


class SyncVerifier:
    """Probes the engines after every ``every``-th sync; raises :class:`SyncNotApplied`."""

    def __init__(self, engine: Any, ids: list[int], every: int, tolerance: float) -> None:
        self.engine, self.ids, self.every, self.tolerance = engine, ids, every, tolerance
        self.syncs = 0
        self.reference: tuple[int, list[float]] | None = None  # (version, trainer log-probs)

    def remember(self, model: torch.nn.Module, version: int) -> None:
        """The trainer's probe log-probs at ``version`` (before the first sync of a run)."""
        if self.every:
            self.reference = (version, model_prompt_logprobs(model, self.ids))

    def after_sync(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """Verify (when due) that every engine serves ``model`` as ``version``; metrics."""
        self.syncs += 1
        if not self.every or self.syncs % self.every:
            return {}
        t0 = time.perf_counter()
        want = model_prompt_logprobs(model, self.ids)
        got = engine_prompt_logprobs(self.engine, self.ids)
        worst = 0.0
        for name, lp in got.items():
            gap = mean_gap(lp, want)
            worst = max(worst, gap)
            self.judge(name, version, gap, lp)
        self.reference = (version, want)
        if hasattr(self.engine, "probe"):  # an HTTP server that comes back is checked too
            self.engine.probe = (self.ids, want, self.tolerance)
        return {
            "sync/verify_gap": worst,
            "sync/verify_s": time.perf_counter() - t0,
            "sync/verified_engines": float(len(got)),
        }

    def judge(self, name: str, version: int, gap: float, lp: list[float]) -> None:
        """Raise :class:`SyncNotApplied` when engine ``name``'s probe log-probs ``lp``, ``gap``
        nats/token from the trainer's at ``version``, show the sync was not applied."""
        tol = self.tolerance
        why = ""
        if gap > tol:
            why = f"over the tolerance {tol:g}"
        elif gap > tol / 10 and self.reference is not None and self.reference[0] != version:
            old_version, old = self.reference
            old_gap = mean_gap(lp, old)
            if 2 * old_gap < gap:
                why = f"and {old_gap:.4g} from the previous version {old_version}: not applied"
        if why:
            raise SyncNotApplied(
                f"weight sync not applied: engine {name} serves log-probs {gap:.4g} nats/token "
                f"away from the trainer's policy version {version} {why} "
                "(engine.verify_tolerance; docs/operations.md, 'Sync verification')"
            )


# -- the running guard --------------------------------------------------------------------------


def check_rollout_gap(limit: float, m: dict[str, float], trajs: list[Any], step: int) -> None:
    """Stop (exit 3) when an on-policy step's ``train/rollout_logprob_gap`` is over ``limit``.

    On-policy: every trajectory of step ``step`` was generated by policy version ``step - 1``,
    so the engine's sampling log-probs and the trainer's recomputed ones should be the same
    model's (up to kernel noise). A lagged or stale batch (``engine.sync_every`` > 1, the Ray
    async modes) is skipped: there the gap measures the lag, not a fault. So are steps with
    turns sampled at ``train.sampling.retry_temperature`` (log-probs of another temperature)
    and with greedy episodes (``greedy_per_group``: no sampling log-probs). ``limit`` 0 switches
    the guard off.
    """
    gap = m.get("train/rollout_logprob_gap")
    if not limit or gap is None or not trajs or m.get("rollout/retried_turn_frac", 0.0) > 0:
        return
    if any(t.policy_version != step - 1 or t.info.get("greedy") for t in trajs) or gap <= limit:
        return
    raise SyncNotApplied(
        f"GRPO step {step}: train/rollout_logprob_gap {gap:.4g} nats/token on an on-policy "
        f"batch (policy version {step - 1}) is over faults.max_rollout_logprob_gap={limit:g}: "
        "the engines do not sample the policy the trainer holds"
    )
