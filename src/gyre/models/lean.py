"""A lean forward for Llama-family causal LMs, over the Hugging Face module's own parameters.

Why: on small models a Hugging Face forward is mostly fixed per-op cost -- module calls, mask
and cache objects built every step, three projections where one matmul would do, a
``torch.cat`` of the whole KV cache per decode step. This module runs the same maths with
fewer ops: fused Q/K/V and gate/up projections (one matmul each over the concatenated
weights), RoPE from a position table, ``torch.nn.functional.rms_norm``, one attention mask per
forward shared by every layer, and KV appends written in place into a preallocated buffer.

Decode attention reads the cache views with two strided ``bmm`` (no copy of the cache); when
the engine forked a group's prompt (prefix sharing), the forked columns are attended once per
group (:func:`~gyre.models.lean_decode.cascade_attention`, "cascade" attention: each prompt's
keys/values are read once per group instead of once per row, one softmax over prefix and own
columns), or a fresh batch of forked groups decodes in the grouped layout. Both, and the cache
row selection the engine uses, are in :mod:`gyre.models.lean_decode`.

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
``hidden(shared_attn=False)``, ``lean_decode.select_kv_rows(group=False)``) turns off only the
per-group
prefix attention.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gyre.models.lean_decode import cascade_attention, prepare_cache, row_decode_attention

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
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


def checkpointed(model: torch.nn.Module) -> bool:
    """Whether the model's decoder layers are set to recompute activations in backward."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return bool(layers) and bool(getattr(layers[0], "gradient_checkpointing", False))


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in backward (``perf.activation_checkpointing``): the Hugging
    Face forward through transformers' own switch, the lean forward by reading its flag."""
    if not getattr(model, "supports_gradient_checkpointing", True):
        raise ValueError(
            f"perf.activation_checkpointing: {type(model).__name__} does not support it"
        )
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers before the rename
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _lin(x: torch.Tensor, mod: torch.nn.Module) -> torch.Tensor:
    """``mod(x)`` for a plain ``nn.Linear``, its parameters read without ``__getattr__``."""
    p = mod._parameters
    return F.linear(x, p["weight"], p["bias"])


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x) * [-sin1, sin2]."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


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
        layout or :func:`~gyre.models.lean_decode.cascade_attention`); off, every row attends its
        own copy.
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
        if cache is not None:
            prepare_cache(cache, step, shared_attn)
        gmask = None  # the grouped layout's block mask, built by the first layer that needs it
        # Activation checkpointing (perf.activation_checkpointing, set on the HF layers by
        # enable_activation_checkpointing): a cache-free forward under autograd keeps only each
        # layer's input and recomputes the layer in backward.
        ckpt = cache is None and torch.is_grad_enabled() and checkpointed(self.model)
        for li, params in enumerate(self._layers()):
            if ckpt:
                x = checkpoint(
                    self._plain_layer, x, li, params, cos, sin, mask, fuse, use_reentrant=False
                )
                continue
            if cache is None:
                x = self._plain_layer(x, li, params, cos, sin, mask, fuse)
                continue
            ln1, ln2, qp, kp, vp, op, gp, up, dp = params
            h = F.rms_norm(x, (x.shape[-1],), ln1, self.eps)
            q, k, v = self._qkv(h, li, (qp, kp, vp), cos, sin, fuse)
            group = getattr(cache.layers[li], "_gyre_group", None) if step else None
            if group is None:
                k, v = _append_kv(cache.layers[li], k, v)
            pre = getattr(cache.layers[li], "_gyre_prefix", None) if decode else None
            if group is not None:  # a fresh batch of forked groups (appends in attend)
                if group.mask is None and gmask is not None and gmask.shape[-1] == group.width:
                    group.mask = gmask  # every layer's block mask is the same (read-only)
                o = group.attend(q, k, v, mask, self.scaling)
                gmask = group.mask
            elif pre is not None and shared_attn and pre.src.shape[0] == B:
                o = cascade_attention(q, k, v, mask, pre, self.scaling)
            elif decode:  # one query per row
                o = row_decode_attention(q, k, v, mask, self.scaling)
            else:
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=gqa
                )
                o = o.transpose(1, 2).reshape(B, C, nh * hd)
            x = self._mlp(x + _lin(o, op), li, ln2, gp, up, dp, fuse)
        return F.rms_norm(x, (x.shape[-1],), inner.norm.weight, self.eps)

    def _plain_layer(
        self,
        x: torch.Tensor,
        li: int,
        params: tuple[Any, ...],
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        fuse: bool,
    ) -> torch.Tensor:
        """Decoder layer ``li`` without a cache (training and scoring): (B, C, hidden) -> same."""
        ln1, ln2, qp, kp, vp, op, gp, up, dp = params
        B, C, _ = x.shape
        h = F.rms_norm(x, (x.shape[-1],), ln1, self.eps)
        q, k, v = self._qkv(h, li, (qp, kp, vp), cos, sin, fuse)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=self.n_kv != self.n_heads
        )
        o = o.transpose(1, 2).reshape(B, C, self.n_heads * self.head_dim)
        return self._mlp(x + _lin(o, op), li, ln2, gp, up, dp, fuse)

    def _mlp(
        self, x: torch.Tensor, li: int, ln2: torch.Tensor, gp: Any, up: Any, dp: Any, fuse: bool
    ) -> torch.Tensor:
        """The residual MLP half of layer ``li``: x + down(silu(gate(h)) * up(h)), h normed."""
        h = F.rms_norm(x, (x.shape[-1],), ln2, self.eps)
        if fuse:
            w, _ = self._cat(3 * li + 1, [gp, up])
            g, u = F.linear(h, w).chunk(2, dim=-1)
        else:
            g, u = _lin(h, gp), _lin(h, up)
        return x + _lin(F.silu(g) * u, dp)

    def _qkv(
        self,
        h: torch.Tensor,
        li: int,
        projs: tuple[torch.nn.Linear, torch.nn.Linear, torch.nn.Linear],
        cos: torch.Tensor,
        sin: torch.Tensor,
        fuse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries and keys (RoPE applied) and values, each (B, heads, C, D), of layer ``li``
        from its normed input ``h`` (B, C, hidden): one matmul over the fused Q/K/V weights
        when ``fuse``, else one per projection."""
        B, C, _ = h.shape
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        qp, kp, vp = projs
        if fuse:
            w, b = self._cat(3 * li, [qp, kp, vp])
            qkv = F.linear(h, w, b)
            qk = qkv[..., : (nh + nkv) * hd].view(B, C, nh + nkv, hd)
            qk = _rope(qk, cos, sin)
            q = qk[:, :, :nh].transpose(1, 2)
            k = qk[:, :, nh:].transpose(1, 2)
            v = qkv[..., (nh + nkv) * hd :].view(B, C, nkv, hd).transpose(1, 2)
            return q, k, v
        q = _rope(_lin(h, qp).view(B, C, nh, hd), cos, sin).transpose(1, 2)
        k = _rope(_lin(h, kp).view(B, C, nkv, hd), cos, sin).transpose(1, 2)
        v = _lin(h, vp).view(B, C, nkv, hd).transpose(1, 2)
        return q, k, v

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
