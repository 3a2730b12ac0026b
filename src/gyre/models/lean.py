"""A lean forward for Llama-family causal LMs, over the Hugging Face module's own parameters.

Why: on small models a Hugging Face forward is mostly fixed per-op cost -- module calls, mask
and cache objects built every step, three projections where one matmul would do, a
``torch.cat`` of the whole KV cache per decode step. This module runs the same maths with
fewer ops: fused Q/K/V and gate/up projections (one matmul each over the concatenated
weights), RoPE from a position table, ``torch.nn.functional.rms_norm``, one attention mask per
forward shared by every layer, and KV appends written in place into a preallocated buffer.

Decode attention reads the cache views with two strided ``bmm`` (no copy of the cache); when
the engine forked a group's prompt (prefix sharing), the forked columns are attended once per
group (:func:`_shared_prefix_attention`, "cascade" attention: each prompt's keys/values are
read once per group instead of once per row, one softmax over prefix and own columns).

It reads the parameters of the wrapped module at every call (no weight copy): gradients,
optimizer state, weight sync and checkpoints are those of the Hugging Face model. Fused
weights used without autograd (the engine) are cached and rebuilt when a parameter changes
(``Tensor._version`` moves on every in-place update: optimizer steps, ``load_weights``).

Anything the lean path does not implement makes :func:`lean_for` return None; the reason is
logged once per model class and reason, and the caller uses the Hugging Face forward.
Implemented: ``llama``, ``mistral`` (no sliding window) and ``qwen2`` (no sliding window)
model types; SiLU MLP without bias; attention with or without Q/K/V bias (``attention_bias``,
Qwen2's biases); grouped-query attention; RoPE types ``default``, ``linear``, ``llama3``,
``yarn``; tied or untied LM head; no attention dropout; no LoRA/peft wrapper. Switches (the
run config's ``perf:`` section): ``perf.engine_lean_forward`` / ``TorchEngine(lean_forward=
False)``, ``perf.train_lean_forward`` / ``ScoringOptions(lean=False)``;
``perf.shared_prefix_attention`` / ``TorchEngine(shared_prefix_attention=False)`` (here:
``hidden(shared_attn=False)``, ``select_kv_rows(group=False)``) turns off only the per-group
prefix attention.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
SHARED_PREFIX_MIN = 8
"""Forked prefixes at least this long are attended once per group in decode (unless the engine's
``shared_prefix_attention`` is off)."""
GROUP_MAX_STEPS = 128
"""The grouped decode layout (:class:`_Group`) attends every row's query to all G rows' own
columns of its group; past this many decode steps the per-row layout costs less (measured:
at 64 rows x 256 new tokens, about 10 % faster when switching at 16-128 steps; at 64 and 128
new tokens, staying grouped is faster)."""
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
_WARNED: set[tuple[str, str]] = set()


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why :class:`LeanForward` cannot run ``model`` exactly, or None when it can."""
    if hasattr(model, "peft_config"):
        return "a peft (LoRA) wrapper"
    if _sharded(model):
        return "FSDP-sharded parameters (the lean path bypasses FSDP's unshard hooks)"
    cfg = getattr(model, "config", None)
    if cfg is None:
        return "no config"
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED_TYPES:
        return f"model_type {mtype!r} (lean path: {', '.join(SUPPORTED_TYPES)})"
    inner = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if inner is None or not isinstance(head, torch.nn.Linear):
        return "no .model / .lm_head Linear"
    if head.bias is not None:
        return "LM head with bias"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if getattr(cfg, "mlp_bias", False):
        return "mlp_bias"
    if float(getattr(cfg, "attention_dropout", 0.0) or 0.0) != 0.0:
        return "attention_dropout > 0"
    if int(getattr(cfg, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1"
    if getattr(cfg, "sliding_window", None) is not None and (
        mtype == "mistral" or getattr(cfg, "use_sliding_window", False)
    ):
        return "sliding-window attention"
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))}"
    for name in ("final_logit_softcapping", "logit_scale", "attn_logit_softcapping"):
        if getattr(cfg, name, None):
            return name
    rope = getattr(getattr(inner, "rotary_emb", None), "rope_type", None)
    if rope not in STATIC_ROPE:
        return f"rope type {rope!r} (lean path: {', '.join(STATIC_ROPE)})"
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager", None):
        return f"attention implementation {cfg._attn_implementation!r}"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer.input_layernorm).__name__ not in (
            "LlamaRMSNorm",
            "MistralRMSNorm",
            "Qwen2RMSNorm",
        ):
            return f"norm {type(layer.input_layernorm).__name__}"
        if any(getattr(attn, n, None) is not None for n in ("q_norm", "k_norm")):
            return "q/k norms"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "MLP is not gate/up/down"
    if not _plain_linears(inner):
        return "projections that are not plain nn.Linear (e.g. LoRA layers)"
    return None


def _sharded(model: torch.nn.Module) -> bool:
    """FSDP2 (``fully_shard``) swaps the module classes and shards parameters as DTensors."""
    if type(model).__name__.startswith("FSDP"):
        return True
    layers = getattr(getattr(model, "model", None), "layers", None)
    return bool(layers) and type(layers[0]).__name__.startswith("FSDP")


def _plain_linears(inner: torch.nn.Module) -> bool:
    """Every projection is still a plain ``nn.Linear`` (peft injects LoRA layers in place, after
    the lean forward may have been built)."""
    linear = torch.nn.Linear
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for layer in inner._modules["layers"]._modules.values():  # no __getattr__: runs per forward
        mods = {**layer._modules["self_attn"]._modules, **layer._modules["mlp"]._modules}
        if any(type(mods.get(n)) is not linear for n in names):
            return False
    return True


def lean_for(model: torch.nn.Module, enabled: bool = True) -> LeanForward | None:
    """The model's :class:`LeanForward` (cached on the model), or None (reason logged once)."""
    if not enabled:
        return None
    cached = model.__dict__.get("_gyre_lean")
    if cached is not None and _plain_linears(cached.inner) and not _sharded(model):
        return cached
    reason = unsupported_reason(model)
    if reason is not None:
        key = (type(model).__name__, reason)
        if key not in _WARNED:
            _WARNED.add(key)
            log.warning("lean forward off for %s: %s; using the Hugging Face forward", *key)
        return None
    lean = LeanForward(model)
    model.__dict__["_gyre_lean"] = lean  # not a submodule: no state_dict / parameters entry
    return lean


def _lin(x: torch.Tensor, mod: torch.nn.Module) -> torch.Tensor:
    """``mod(x)`` for a plain ``nn.Linear``, its parameters read without ``__getattr__``."""
    p = mod._parameters
    return F.linear(x, p["weight"], p["bias"])


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x) * [-sin1, sin2]."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def _softmax(s: torch.Tensor) -> torch.Tensor:
    """``s.softmax(-1)`` for attention scores. Below 16 columns torch's CPU softmax takes a
    scalar path (256 rows of 13: ~60 us, of 16: ~6 us), which a decode step over a short
    prompt hits in every layer; there the scores are padded to 16 columns of -inf (exactly 0
    after the softmax, which a finite masked maximum keeps) and the padding sliced off."""
    K = s.shape[-1]
    if K >= 16 or s.device.type != "cpu" or s.numel() < 128 * K:
        return s.softmax(-1)
    return F.pad(s, (0, 16 - K), value=float("-inf")).softmax(-1)[..., :K]


def _append_kv(layer: Any, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append (B, H, C, D) keys/values to a DynamicLayer, in place when its buffer has room.

    ``layer.keys`` stays a view ``buf[:, :, :L]`` of a buffer this layer owns; columns below L
    are never written again, so snapshots (views of the first L columns, the engine's parked
    sessions) stay valid. If ``layer.keys`` was replaced (gather, merge, a snapshot adopted
    from another batch), the first append copies it into a fresh buffer of doubled capacity.
    """
    C = k.shape[2]
    buf = getattr(layer, "_gyre_buf", None)
    old = layer.keys if layer.is_initialized else None
    L = 0 if old is None else old.shape[2]
    own = (
        buf is not None
        and old is not None
        and old.data_ptr() == buf[0].data_ptr()
        and old.shape[:2] == buf[0].shape[:2]
        and old.stride() == buf[0].stride()
    )
    if not own:
        layer._gyre_prefix = None  # rows/columns were rearranged by someone else
    ok = own and buf is not None and buf[0].shape[2] >= L + C
    if not ok:
        B, H, _, D = k.shape
        cap = max(2 * (L + C), L + C + 16)
        bk = k.new_empty(B, H, cap, D)
        bv = v.new_empty(B, H, cap, D)
        if L:
            bk[:, :, :L].copy_(old)
            bv[:, :, :L].copy_(layer.values)
        buf = (bk, bv)
        layer._gyre_buf = buf
        if not layer.is_initialized:
            layer.lazy_initialization(k, v)
    bk, bv = buf
    bk[:, :, L : L + C].copy_(k)
    bv[:, :, L : L + C].copy_(v)
    layer.keys, layer.values = bk[:, :, : L + C], bv[:, :, : L + C]
    return layer.keys, layer.values


class LeanForward:
    """The lean forward of one Llama-family ``*ForCausalLM`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        cfg = model.config
        self.inner = model.model
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        self.scaling = self.head_dim**-0.5
        self.eps = float(cfg.rms_norm_eps)
        self.layer_params = sum(p.numel() for p in self.inner.layers.parameters())
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fused: dict[int, tuple[tuple[int, ...], torch.Tensor, torch.Tensor | None]] = {}
        self._scope: int | None = None  # set by reuse_fused(): fused weights may be cached
        self._scopes = 0

    @contextlib.contextmanager
    def reuse_fused(self) -> Iterator[None]:
        """Within this block the parameters do not change, so fused Q/K/V and gate/up weights
        are built once and reused (the engine wraps each ``generate`` in it). Outside it they
        are concatenated at every forward: a parameter's ``_version`` cannot tell whether it
        changed (``torch.optim.AdamW(fused=True)`` updates weights in place without bumping
        it), so a cache kept across calls could serve stale weights."""
        outer = self._scope
        self._scopes += 1
        self._scope = self._scopes  # a new number per block: nothing cached before matches
        try:
            yield
        finally:
            self._scope = outer

    # -- weights ----------------------------------------------------------------------------
    def _cat(self, key: int, mods: list[torch.nn.Linear]) -> tuple[torch.Tensor, Any]:
        """One weight (and bias) over several Linear layers. Under autograd the cat is part of
        the graph (gradients reach each layer's own parameter); without it the result is
        cached for the current :meth:`reuse_fused` block (and its parameter objects), else
        built anew."""
        ws = [m._parameters["weight"] for m in mods]
        bs = [m._parameters["bias"] for m in mods]
        has_bias = any(b is not None for b in bs)
        if has_bias:
            bs = [
                b if b is not None else m.weight.new_zeros(m.out_features)
                for b, m in zip(bs, mods, strict=True)
            ]
        if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
            return torch.cat(ws), torch.cat(bs) if has_bias else None
        if self._scope is None:
            with torch.no_grad():
                return torch.cat(ws), torch.cat(bs) if has_bias else None
        tensors = ws + (bs if has_bias else [])
        stamp = (self._scope, *(t._version for t in tensors), *(t.data_ptr() for t in tensors))
        hit = self._fused.get(key)
        if hit is None or hit[0] != stamp:
            with torch.no_grad():
                w = torch.cat(ws)
                b = torch.cat(bs) if has_bias else None
            hit = (stamp, w, b)
            self._fused[key] = hit
        return hit[1], hit[2]

    def _rope_table(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for positions 0..n-1 (grown by doubling), from the model's own
        rotary module, so every static RoPE variant gives exactly its values."""
        t = self._table
        if t is None or t[0].shape[0] < n or t[0].device != like.device or t[0].dtype != like.dtype:
            size = max(n, 2 * (t[0].shape[0] if t is not None else 64))
            pos = torch.arange(size, device=like.device)[None]
            with torch.no_grad():
                cos, sin = self.inner.rotary_emb(like, position_ids=pos)
            cos, sin = cos[0], sin[0]
            half = self.head_dim // 2
            sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
            t = (cos, sin)
            self._table = t
        return t

    def _layers(self) -> list[tuple[Any, ...]]:
        """Per layer (input norm weight, post-attention norm weight, q, k, v, o, gate, up, down
        Linear modules), read from the modules' own dicts: this runs every forward, and
        ``nn.Module.__getattr__`` costs about a microsecond a lookup, several percent of a
        small model's decode step."""
        out = []
        for layer in self.inner._modules["layers"]._modules.values():
            m = layer._modules
            a, f = m["self_attn"]._modules, m["mlp"]._modules
            out.append(
                (
                    m["input_layernorm"]._parameters["weight"],
                    m["post_attention_layernorm"]._parameters["weight"],
                    a["q_proj"],
                    a["k_proj"],
                    a["v_proj"],
                    a["o_proj"],
                    f["gate_proj"],
                    f["up_proj"],
                    f["down_proj"],
                )
            )
        return out

    # -- forward ----------------------------------------------------------------------------
    def hidden(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: Any = None,
        shared_attn: bool = True,
    ) -> torch.Tensor:
        """Final-norm hidden states (B, C, H) of ``input_ids`` (B, C).

        ``mask`` is an additive float mask (B, 1, C, K) over the K keys (cached ones first);
        ``cache`` is a transformers DynamicCache whose layers get the new keys/values appended
        (None: no cache, K = C). ``shared_attn`` (the engine's ``shared_prefix_attention``):
        one-token decode steps attend a forked group's prefix once per group (the grouped
        layout or :func:`_shared_prefix_attention`); off, every row attends its own copy.
        """
        inner = self.inner
        B, C = input_ids.shape
        x = inner.embed_tokens(input_ids)
        cos_t, sin_t = self._rope_table(int(position_ids.max()) + 1, x)
        cos = cos_t[position_ids].unsqueeze(2)  # (B, C, 1, D)
        sin = sin_t[position_ids].unsqueeze(2)
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        gqa = nkv != nh
        step = cache is not None and C == 1  # a one-token decode step
        decode = step and not gqa  # per-row / shared-prefix decode attention (no GQA)
        # Fused Q/K/V and gate/up weights pay without autograd (cached); under autograd the
        # cat and its backward (a zero-filled slice per weight) cost more than they save.
        fuse = not (torch.is_grad_enabled() and inner.embed_tokens.weight.requires_grad)
        if cache is not None and not (step and shared_attn):
            ungroup_cache(cache)  # the grouped layout serves one-token decode steps only
        elif cache is not None:
            group = getattr(cache.layers[0], "_gyre_group", None)
            if group is not None and group.steps >= GROUP_MAX_STEPS:
                ungroup_cache(cache)  # long completions: G x own columns cost more than rows
        gmask = None  # the grouped layout's block mask, built by the first layer that needs it
        for li, (ln1, ln2, qp, kp, vp, op, gp, up, dp) in enumerate(self._layers()):
            h = F.rms_norm(x, (x.shape[-1],), ln1, self.eps)
            if fuse:
                w, b = self._cat(3 * li, [qp, kp, vp])
                qkv = F.linear(h, w, b)
                qk = qkv[..., : (nh + nkv) * hd].view(B, C, nh + nkv, hd)
                qk = _rope(qk, cos, sin)
                q = qk[:, :, :nh].transpose(1, 2)
                k = qk[:, :, nh:].transpose(1, 2)
                v = qkv[..., (nh + nkv) * hd :].view(B, C, nkv, hd).transpose(1, 2)
            else:
                q = _rope(_lin(h, qp).view(B, C, nh, hd), cos, sin).transpose(1, 2)
                k = _rope(_lin(h, kp).view(B, C, nkv, hd), cos, sin).transpose(1, 2)
                v = _lin(h, vp).view(B, C, nkv, hd).transpose(1, 2)
            group = getattr(cache.layers[li], "_gyre_group", None) if step else None
            if group is None and cache is not None:
                k, v = _append_kv(cache.layers[li], k, v)
            pre = getattr(cache.layers[li], "_gyre_prefix", None) if decode else None
            if group is not None:  # a fresh batch of forked groups (appends in attend)
                if group.mask is None and gmask is not None and gmask.shape[-1] == group.width:
                    group.mask = gmask  # every layer's block mask is the same (read-only)
                o = group.attend(q, k, v, mask, self.scaling)
                gmask = group.mask
            elif pre is not None and shared_attn and pre.src.shape[0] == B:
                o = _shared_prefix_attention(q, k, v, mask, pre, self.scaling)
            elif decode:
                # one query per row: two strided bmm on the cache views, no copy of the cache
                K = k.shape[2]
                s = torch.baddbmm(
                    mask.expand(B, nh, 1, K).reshape(B * nh, 1, K),
                    q.reshape(B * nh, 1, hd),
                    k.reshape(B * nh, K, hd).transpose(1, 2),
                    alpha=self.scaling,
                )
                o = torch.bmm(_softmax(s), v.reshape(B * nh, K, hd)).view(B, 1, nh * hd)
            else:
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=gqa
                )
                o = o.transpose(1, 2).reshape(B, C, nh * hd)
            x = x + _lin(o, op)
            h = F.rms_norm(x, (x.shape[-1],), ln2, self.eps)
            if fuse:
                w, _ = self._cat(3 * li + 1, [gp, up])
                g, u = F.linear(h, w).chunk(2, dim=-1)
            else:
                g, u = _lin(h, gp), _lin(h, up)
            x = x + _lin(F.silu(g) * u, dp)
        return F.rms_norm(x, (x.shape[-1],), inner.norm.weight, self.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.model.lm_head.weight)

    # -- masks ------------------------------------------------------------------------------
    @staticmethod
    def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Bool (.., Q, K) -> additive float mask (0 where allowed, dtype min elsewhere)."""
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
        return torch.where(allowed, zero, neg)

    def cached_mask(self, colmask: torch.Tensor, chunk: int, dtype: torch.dtype) -> torch.Tensor:
        """The mask of a chunk of ``chunk`` new tokens appended to a cache whose column mask,
        new columns included, is ``colmask`` (B, K): a key is visible if it is real and not
        after the query (keys are in cache order)."""
        K = colmask.shape[1]
        real = colmask.bool()[:, None, None, :]  # (B, 1, 1, K)
        if chunk == 1:
            return self.additive(real, dtype)
        q_pos = torch.arange(K - chunk, K, device=colmask.device)[:, None]
        causal = torch.arange(K, device=colmask.device)[None, :] <= q_pos  # (C, K)
        return self.additive(real & causal[None, None], dtype)

    def segment_mask(self, position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Block-diagonal causal mask of packed rows: a new segment starts wherever the
        position id does not continue the previous one (as transformers detects packing)."""
        W = position_ids.shape[1]
        starts = torch.ones_like(position_ids, dtype=torch.bool)
        starts[:, 1:] = (position_ids[:, 1:] - position_ids[:, :-1]) != 1
        seg = starts.long().cumsum(dim=1)
        same = seg[:, :, None] == seg[:, None, :]
        causal = torch.ones(W, W, dtype=torch.bool, device=position_ids.device).tril()
        return self.additive((same & causal)[:, None], dtype)

    def padded_mask(self, attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Causal mask of a right-padded batch (padding keys hidden)."""
        T = attention_mask.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()
        return self.additive(causal[None, None] & attention_mask.bool()[:, None, None, :], dtype)


@dataclass
class _Prefix:
    """Columns [0, length) of every row r equal row ``src[r]`` of ``keys``/``values`` (U rows):
    a group's prompt, prefilled once and forked. Decode attention reads them once per group."""

    keys: torch.Tensor  # (U, H, length, D)
    values: torch.Tensor
    src: torch.Tensor  # (B,) long
    length: int


_SRC_MEMO: list[Any] = [None]  # [(old src, idx, new src)]: one src object per select


def _select_src(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``src[idx]``, the same tensor object for every layer of one select (so the grouping
    computed from it is shared by all layers)."""
    memo = _SRC_MEMO[0]  # one read of one tuple: consistent even if another thread writes
    if memo is not None and memo[0] is src and memo[1] is idx:
        return memo[2]
    new = src.index_select(0, idx)
    _SRC_MEMO[0] = (src, idx, new)
    return new


def select_kv_rows(
    layer: Any, idx: torch.Tensor, fork_min: int = SHARED_PREFIX_MIN, group: bool = True
) -> None:
    """Keep rows ``idx`` of a DynamicLayer; a lean-owned buffer is gathered whole, so the
    layer keeps its spare capacity (no reallocation at the next append).

    A fork (``idx`` repeating rows, as the engine's prefix sharing does) of at least
    ``fork_min`` columns records the pre-fork rows as a shared prefix (:class:`_Prefix`), which
    decode attention then reads once per group instead of once per row. ``group`` (the
    engine's ``shared_prefix_attention``) lets a fork of whole groups take the grouped layout
    (:class:`_Group`); off, forked rows are gathered per row.
    """
    if getattr(layer, "_gyre_group", None) is not None and not _repeats(idx):
        ungroup(layer, idx)  # the kept rows, written once in the per-row layout
        return
    ungroup(layer)
    buf = getattr(layer, "_gyre_buf", None)
    keys = layer.keys
    own = buf is not None and keys.data_ptr() == buf[0].data_ptr()
    if own and keys.stride() == buf[0].stride():
        L = keys.shape[2]
        pre = getattr(layer, "_gyre_prefix", None)
        G = _fork_groups(idx) if pre is None and group else 0
        if G:
            heads = idx[::G]  # the source row of each group of G forked rows
            layer._gyre_group = _Group.fork(
                keys.index_select(0, heads), layer.values.index_select(0, heads), G
            )
            layer._gyre_prefix = None
            layer.keys = layer.values = None  # stale while grouped: ungroup() restores them
            return
        if pre is not None:
            pre = _Prefix(pre.keys, pre.values, _select_src(pre.src, idx), pre.length)
        elif L >= fork_min and idx.numel() > keys.shape[0]:
            pre = _Prefix(keys, layer.values, idx, L)
        bk, bv = buf[0].index_select(0, idx), buf[1].index_select(0, idx)
        layer._gyre_buf = (bk, bv)
        layer._gyre_prefix = pre
        layer.keys, layer.values = bk[:, :, :L], bv[:, :, :L]
        return
    layer._gyre_prefix = None
    layer.keys = keys.index_select(0, idx)
    layer.values = layer.values.index_select(0, idx)


_GROUPING: list[Any] = [None]  # [(src, grouping)]


def _grouping(src: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(gidx (U*G,) row index per group slot, B for an empty slot; rowpos (B,) slot of each
    row; G = the largest group), cached for the last ``src`` object."""
    memo = _GROUPING[0]
    if memo is not None and memo[0] is src:
        return memo[1]
    B = src.shape[0]
    counts = torch.bincount(src, minlength=groups)
    G = int(counts.max())
    order = torch.argsort(src, stable=True)
    start = torch.cumsum(counts, 0) - counts
    slot = torch.empty(B, dtype=torch.long, device=src.device)
    slot[order] = torch.arange(B, device=src.device) - start[src[order]]
    rowpos = src * G + slot
    gidx = torch.full((groups * G,), B, dtype=torch.long, device=src.device)
    gidx[rowpos] = torch.arange(B, device=src.device)
    out = (gidx, rowpos, G)
    _GROUPING[0] = (src, out)
    return out


def _shared_prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    pre: _Prefix,
    scale: float,
) -> torch.Tensor:
    """One-query decode attention (B, H, 1, D) -> (B, 1, H*D) over keys whose first
    ``pre.length`` columns are a shared prefix: scores and weighted values of the prefix are
    computed per group (one small matmul per group and head, reading each prefix once), the
    row's own columns per row; one softmax over both (the same maths as plain attention)."""
    B, H, _, D = q.shape
    K, L0 = k.shape[2], pre.length
    U = pre.keys.shape[0]
    gidx, rowpos, G = _grouping(pre.src, U)
    q3 = q.reshape(B, H, D)
    qpad = torch.cat([q3, q3.new_zeros(1, H, D)])[gidx]  # (U*G, H, D)
    qg = qpad.view(U, G, H, D).transpose(1, 2).reshape(U * H, G, D)
    sp = torch.bmm(qg, pre.keys.reshape(U * H, L0, D).transpose(1, 2))  # (U*H, G, L0)
    sp = sp.view(U, H, G, L0).transpose(1, 2).reshape(U * G, H, L0)[rowpos]  # (B, H, L0)
    ks = k[:, :, L0:].reshape(B * H, K - L0, D)
    ss = torch.bmm(q.reshape(B * H, 1, D), ks.transpose(1, 2)).view(B, H, K - L0)
    p = (torch.cat([sp, ss], dim=-1) * scale + mask.view(B, 1, K)).softmax(-1)
    pg = p.new_zeros(U * G, H, L0)
    pg[rowpos] = p[..., :L0]
    op = torch.bmm(
        pg.view(U, G, H, L0).transpose(1, 2).reshape(U * H, G, L0),
        pre.values.reshape(U * H, L0, D),
    )
    op = op.view(U, H, G, D).transpose(1, 2).reshape(U * G, H, D)[rowpos]
    vs = v[:, :, L0:].reshape(B * H, K - L0, D)
    os_ = torch.bmm(p[..., L0:].reshape(B * H, 1, K - L0), vs).view(B, H, D)
    return (op + os_).view(B, 1, H * D)


def _repeats(idx: torch.Tensor) -> bool:
    """Whether ``idx`` names some row more than once (a fork rather than a selection)."""
    return idx.numel() > 1 and bool((idx.sort().values.diff() == 0).any())


def _fork_groups(idx: torch.Tensor) -> int:
    """G >= 2 when ``idx`` is a fork into consecutive groups of G equal rows (a prompt asked
    k x G times, e.g. a task drawn twice, makes k groups of the same source); else 0."""
    n = idx.numel()
    if n < 2:
        return 0
    starts = torch.ones(n, dtype=torch.bool, device=idx.device)
    starts[1:] = idx[1:] != idx[:-1]
    bounds = [*starts.nonzero().flatten().tolist(), n]
    G = math.gcd(*(b - a for a, b in itertools.pairwise(bounds)))
    return G if G >= 2 else 0


class _Group:
    """Decode cache of B = U x G rows forked from U prompts, G rows each, in group order.

    A group's keys (values alike) live in one buffer row ``(H, L0 + G x cap, D)``: the prompt
    once (columns ``[0, L0)``), then the rows' own tokens step-major (column
    ``L0 + t x G + g`` is row g's token t), so one decode step appends one contiguous block
    per group and the keys visible at step t are a contiguous prefix of the buffer. Decode
    attention is then one batched matmul per group and head for scores and one for values,
    over the prompt and every row's own columns, with a fixed mask that lets row g see the
    prompt (its real columns) and its own columns only: the same softmax as per-row attention
    (masked terms are exactly 0), with no per-row copy of the prompt (the fork copies nothing
    but the prompt, once) and a handful of ops instead of per-row gathers.

    Anything but a one-token decode step (compaction, a snapshot, merging an admission, a
    prefill chunk, the Hugging Face forward) first calls :func:`ungroup`, which writes the
    standard per-row layout back (and keeps the prompt as a shared prefix).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, prefix: int, G: int) -> None:
        self.keys, self.values = keys, values  # (U, H, L0 + G * cap, D)
        self.prefix, self.G, self.steps = prefix, G, 0
        self.rep = 1  # query heads per key/value head (set by every step)
        self.mask: torch.Tensor | None = None  # (U, H, rep*G, width) additive, 1st step

    @classmethod
    def fork(cls, keys: torch.Tensor, values: torch.Tensor, G: int, cap: int = 16) -> _Group:
        U, H, L0, D = keys.shape
        gk = keys.new_empty(U, H, L0 + G * cap, D)
        gv = values.new_empty(U, H, L0 + G * cap, D)
        gk[:, :, :L0].copy_(keys)
        gv[:, :, :L0].copy_(values)
        return cls(gk, gv, L0, G)

    @property
    def width(self) -> int:
        return int(self.keys.shape[2])

    @property
    def capacity(self) -> int:
        return (self.keys.shape[2] - self.prefix) // self.G

    def _grow(self) -> None:
        U, H, _, D = self.keys.shape
        used = self.prefix + self.G * self.steps
        width = self.prefix + self.G * 2 * max(self.capacity, 8)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(U, H, width, D)
            new[:, :, :used].copy_(old[:, :, :used])
            setattr(self, name, new)
        if self.mask is not None:
            self.mask = self._build_mask(self.mask[:, 0, 0, : self.prefix])

    def _build_mask(self, prefix_mask: torch.Tensor) -> torch.Tensor:
        """(U, H, rep x G, width) additive mask from the prompt's (U, L0) additive mask: query
        row ``r * G + g`` (query head r of a key/value head, sample g) sees the prompt and
        sample g's own columns."""
        U, H, width, _ = self.keys.shape
        G, L0, rep = self.G, self.prefix, self.rep
        cap = (width - L0) // G
        own = torch.eye(G, dtype=torch.bool, device=self.keys.device).repeat(rep, cap)
        neg = torch.finfo(prefix_mask.dtype).min
        own_add = torch.where(own, 0.0, neg).to(prefix_mask.dtype)  # (rep*G, G*cap)
        m = torch.empty(U, rep * G, width, dtype=prefix_mask.dtype, device=prefix_mask.device)
        m[:, :, :L0] = prefix_mask[:, None, :]
        m[:, :, L0:] = own_add[None]
        return m[:, None].expand(U, H, rep * G, width).contiguous()

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Append this step's (B, Hkv, 1, D) keys/values, attend (B, Hq, 1, D) queries; returns
        (B, 1, Hq*D). ``mask`` is the engine's (B, 1, 1, K) additive mask (its prompt columns
        give each group's prompt padding, read once). Grouped-query attention (Hq = rep x Hkv,
        query head h reading key/value head h // rep) stacks a key/value head's rep query
        heads and G samples into one (rep x G)-row matmul."""
        B, Hq, _, D = q.shape
        H = k.shape[1]
        rep = Hq // H
        G, L0 = self.G, self.prefix
        U = B // G
        self.rep = rep  # before _grow: it rebuilds the mask
        if self.steps >= self.capacity:
            self._grow()
        if self.mask is None:
            self.mask = self._build_mask(mask[::G, 0, 0, :L0])
        c = L0 + self.steps * G
        self.keys[:, :, c : c + G].copy_(k.reshape(U, G, H, D).transpose(1, 2))
        self.values[:, :, c : c + G].copy_(v.reshape(U, G, H, D).transpose(1, 2))
        self.steps += 1
        K = c + G
        width = self.keys.shape[2]
        R = rep * G  # query rows per (group, key/value head)
        qg = q.reshape(U, G, H, rep, D).permute(0, 2, 3, 1, 4).reshape(U * H, R, D)
        keys = self.keys.view(U * H, width, D)[:, :K]
        s = torch.baddbmm(
            self.mask.view(U * H, R, width)[:, :, :K], qg, keys.transpose(1, 2), alpha=scale
        )
        o = torch.bmm(_softmax(s), self.values.view(U * H, width, D)[:, :K])
        return o.view(U, H, rep, G, D).permute(0, 3, 1, 2, 4).reshape(B, 1, Hq * D)

    def standard(
        self, steps: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(buffer keys, buffer values, keys view, values view) in the per-row layout after
        ``steps`` decode steps (default: all so far): row u*G + g holds the prompt of group
        u, then its own tokens. The group's written columns never change, so an earlier
        ``steps`` gives the cache as it was then."""
        return self.rows(torch.arange(self.keys.shape[0] * self.G), steps)

    def rows(
        self, idx: torch.Tensor, steps: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`standard` of rows ``idx`` only (compaction keeps the live rows: one gather)."""
        U, H, _, D = self.keys.shape
        G, L0 = self.G, self.prefix
        t = self.steps if steps is None else steps
        L = L0 + t
        idx = idx.to(self.keys.device)
        grp, slot = idx // G, idx % G
        cap = max(2 * L, L + 16)
        out = []
        for g in (self.keys, self.values):
            buf = g.new_empty(idx.numel(), H, cap, D)
            buf[:, :, :L0].copy_(g[:, :, :L0].index_select(0, grp))
            own = g[:, :, L0 : L0 + t * G].reshape(U, H, t, G, D)
            buf[:, :, L0:L].copy_(own[grp, :, :, slot])  # (n, H, t, D)
            out.append(buf)
        return out[0], out[1], out[0][:, :, :L], out[1][:, :, :L]


def ungroup(layer: Any, idx: torch.Tensor | None = None) -> None:
    """Write a grouped layer (:class:`_Group`) back to the per-row layout -- only rows ``idx``
    when given (a compaction) -- keeping the prompt as a shared prefix for decode attention
    when it is long enough; no-op for a layer that is not grouped."""
    group = getattr(layer, "_gyre_group", None)
    if group is None:
        return
    if idx is None:
        idx = torch.arange(group.keys.shape[0] * group.G, device=group.keys.device)
    bk, bv, keys, values = group.rows(idx)
    layer._gyre_group = None
    layer._gyre_buf = (bk, bv)
    layer.keys, layer.values = keys, values
    L0 = group.prefix
    if L0 >= SHARED_PREFIX_MIN:
        src = idx.to(bk.device) // group.G
        # copies of the prompt columns, so the group's (much wider) buffers can be freed
        pk, pv = group.keys[:, :, :L0].clone(), group.values[:, :, :L0].clone()
        layer._gyre_prefix = _Prefix(pk, pv, src, L0)
    else:
        layer._gyre_prefix = None


def ungroup_cache(cache: Any) -> None:
    """:func:`ungroup` every layer of a DynamicCache."""
    for layer in cache.layers:
        if getattr(layer, "_gyre_group", None) is not None:
            ungroup(layer)
