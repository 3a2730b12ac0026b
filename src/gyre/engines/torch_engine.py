"""An in-process engine: batched sampling with a Hugging Face model and its KV cache.

Layout of the batched cache: every row starts with a real token at column 0 and new tokens are
appended as right-padded chunks, so padding sits *inside* a row, never before its first token.
Padding columns get attention-mask 0 and do not advance the row's position ids, so a row's
positions are exactly those of its unpadded sequence (what the trainer sees). Because every query
can attend to column 0, no attention row is ever fully masked (which would make sdpa emit NaN).

Multi-turn reuse: the engine remembers, per ``session``, the tokens whose keys/values are in the
cache. A request whose prompt extends them only prefills the new suffix; rows of sessions not in
the request are dropped from the batch (``batch_select_indices``). Identical prompts in a fresh
batch (a GRPO group) are prefilled once and the cache is forked with a row gather.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from transformers import DynamicCache

from gyre.sampling import sample_tokens, sampling_logprobs
from gyre.types import Completion, GenerationRequest, SamplingParams


@dataclass
class _BatchState:
    cache: DynamicCache
    colmask: torch.Tensor  # (B, L) long: 1 where the cache column is a real token of the row
    fed: list[list[int]]  # per row: the real tokens whose KV is in the cache
    sessions: list[Hashable]


class TorchEngine:
    """Engine over a local ``transformers`` causal LM (any architecture with a DynamicCache)."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int, seed: int = 0) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.pad_token_id = pad_token_id
        self.version = 0
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._state: _BatchState | None = None
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "forward_calls": 0}

    # -- weight sync ----------------------------------------------------------------------
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            own = self.model.state_dict()
            for name, tensor in state_dict.items():
                own[name].copy_(tensor)
        self.version = version
        self._state = None  # cached keys/values belong to the old weights

    def load_weights_from_disk(self, path: str | Path, version: int) -> int:
        """Full-weight sync from a Hugging Face folder's safetensors; returns ``version``."""
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in '{path}'")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(safetensors.torch.load_file(f, device=str(self.device)))
        own = self.model.state_dict()
        if hasattr(self.model, "peft_config"):
            raise ValueError("this engine holds a LoRA adapter: sync it with load_adapter")
        missing = [k for k in state if k not in own]
        if missing:
            raise ValueError(f"weights in '{path}' do not fit the engine's model: {missing[:3]}")
        self.load_weights(state, version)
        return version

    def load_adapter(self, path: str | Path, version: int) -> int:
        """Adapter sync: load a peft adapter folder as the active adapter; returns ``version``."""
        from gyre.lora import load_adapter_into

        self.model = load_adapter_into(self.model, Path(path), f"v{version}").eval()
        active = f"v{version}"
        self.model.set_adapter(active)
        for name in list(self.model.peft_config):
            if name != active:
                self.model.delete_adapter(name)
        self.version = version
        self._state = None
        return version

    def release(self, sessions: Iterable[Hashable]) -> None:
        gone = set(sessions)
        if self._state is not None and all(s in gone for s in self._state.sessions):
            self._state = None

    # -- generation -----------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        if not requests:
            return []
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise ValueError(f"request {i} has an empty prompt")
        if params.seed is not None:
            self._generator.manual_seed(params.seed)
        logits = self._prefill(requests)  # (B, V): next-token logits of each row
        state = self._state
        assert state is not None
        B = len(requests)
        stop = set(params.stop_token_ids)
        out_ids: list[list[int]] = [[] for _ in range(B)]
        out_lp: list[list[float]] = [[] for _ in range(B)]
        k = params.top_logprobs
        out_top: list[list[dict[int, float]]] = [[] for _ in range(B)]
        finished = [False] * B
        reasons = ["length"] * B
        for step in range(params.max_new_tokens):
            tokens, logps = sample_tokens(logits, params.temperature, params.top_p, self._generator)
            tok_list, lp_list = tokens.tolist(), logps.tolist()
            if k > 0:
                top = sampling_logprobs(logits, params.temperature, params.top_p).topk(k, dim=-1)
                top_v, top_i = top.values.tolist(), top.indices.tolist()
            for i in range(B):
                if finished[i]:
                    continue
                out_ids[i].append(tok_list[i])
                out_lp[i].append(lp_list[i])
                if k > 0:
                    out_top[i].append(dict(zip(top_i[i], top_v[i], strict=True)))
                if tok_list[i] in stop:
                    finished[i] = True
                    reasons[i] = "stop"
            if all(finished) or step == params.max_new_tokens - 1:
                break
            # Feed the tokens just sampled; finished rows get a masked pad column.
            chunk = [[] if finished[i] else [tok_list[i]] for i in range(B)]
            logits = self._feed(chunk)
        return [
            Completion(out_ids[i], out_lp[i], reasons[i], out_top[i] if k > 0 else None)
            for i in range(B)
        ]

    def _prefill(self, requests: list[GenerationRequest]) -> torch.Tensor:
        state = self._state
        reuse = state is not None and all(r.session is not None for r in requests)
        if reuse:
            assert state is not None
            index = {s: i for i, s in enumerate(state.sessions)}
            rows = []
            for r in requests:
                i = index.get(r.session)
                if i is None:
                    reuse = False
                    break
                fed = state.fed[i]
                if len(r.prompt_ids) <= len(fed) or r.prompt_ids[: len(fed)] != fed:
                    reuse = False
                    break
                rows.append(i)
            if reuse and len(set(rows)) != len(rows):
                reuse = False
        if reuse:
            assert state is not None
            if rows != list(range(len(state.sessions))):
                idx = torch.tensor(rows, device=self.device)
                state.cache.batch_select_indices(idx)
                state.colmask = state.colmask[idx]
                state.fed = [state.fed[i] for i in rows]
            state.sessions = [r.session for r in requests]
            chunk = [r.prompt_ids[len(f) :] for r, f in zip(requests, state.fed, strict=True)]
            return self._feed(chunk)

        # Fresh batch. Prefill each distinct prompt once, then fork rows (prefix sharing).
        keys = [tuple(r.prompt_ids) for r in requests]
        uniq: dict[tuple[int, ...], int] = {}
        inverse = [uniq.setdefault(k, len(uniq)) for k in keys]
        uniq_prompts = [list(k) for k in uniq]
        self._state = _BatchState(
            cache=DynamicCache(config=self.model.config),
            colmask=torch.zeros(len(uniq_prompts), 0, dtype=torch.long, device=self.device),
            fed=[[] for _ in uniq_prompts],
            sessions=[None] * len(uniq_prompts),
        )
        logits = self._feed(uniq_prompts)
        state = self._state
        if len(uniq_prompts) != len(requests):
            idx = torch.tensor(inverse, device=self.device)
            state.cache.batch_select_indices(idx)
            state.colmask = state.colmask[idx]
            state.fed = [list(state.fed[j]) for j in inverse]
            logits = logits[idx]
        state.sessions = [r.session for r in requests]
        return logits

    def _feed(self, chunk: list[list[int]]) -> torch.Tensor:
        """Append one right-padded chunk of tokens per row; return each row's last logits.

        A row with an empty chunk gets a masked pad column and its returned logits are unused.
        """
        state = self._state
        assert state is not None
        B = len(chunk)
        C = max(1, max(len(c) for c in chunk))
        ids = torch.full((B, C), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((B, C), dtype=torch.long)
        pos = torch.zeros((B, C), dtype=torch.long)
        last = torch.zeros(B, dtype=torch.long)
        for i, c in enumerate(chunk):
            n, start = len(c), len(state.fed[i])
            if n:
                ids[i, :n] = torch.tensor(c)
                mask[i, :n] = 1
                pos[i, :n] = torch.arange(start, start + n)
                last[i] = n - 1
            pos[i, n:] = start + max(n - 1, 0)
            state.fed[i].extend(c)
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        state.colmask = torch.cat([state.colmask, mask], dim=1)
        out = self.model(
            input_ids=ids,
            attention_mask=state.colmask,
            position_ids=pos,
            cache=state.cache,
            use_cache=True,
        )
        n_real = int(mask.sum())
        self.stats["forward_calls"] += 1
        if C == 1:
            self.stats["decode_tokens"] += n_real
        else:
            self.stats["prefill_tokens"] += n_real
        return out.logits[torch.arange(B, device=self.device), last.to(self.device)]
