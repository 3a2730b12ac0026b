"""The model behind ``gyre serve``: one engine, a base model, named adapters, checked loads.

Every weight load (the model at start, ``/update_weights_from_disk``, ``load_lora_adapter``)
goes through the same checks before it can change what is served:

- the folder's ``manifest.json``, when it has one (``final/``, ``sft/`` and checkpoint folders
  written by :mod:`gyre.checkpoint.store`), must match its files (sizes and sha256), checked
  with the store's own :func:`~gyre.checkpoint.files.verify_dir`;
- every ``*.safetensors`` file must parse (a truncated file is refused naming the file);
- every floating-point tensor must be finite (a NaN or inf weight is refused naming the tensor).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gyre.checkpoint.files import MANIFEST_FILE, verify_dir
from gyre.engines.torch_engine import TorchEngine
from gyre.engines.verify import PromptToken, prompt_table
from gyre.models.build import load_pretrained
from gyre.models.vision import checkpoint_state, vision_of
from gyre.serve.requests import ApiError, Vocab
from gyre.types import Completion, GenerationRequest, SamplingParams

# -- checks on a folder of weights ----------------------------------------------------------


def checked_folder(path: str | Path, field: str) -> Path:
    """``path`` as a directory whose manifest (if any) matches; else a 400 naming ``field``."""
    try:
        p = Path(path)
        is_dir = p.is_dir()
    except (OSError, ValueError) as exc:  # e.g. an embedded NUL byte
        raise ApiError(400, f"{field} '{path}' is not a usable path: {exc}", field) from exc
    if not is_dir:
        raise ApiError(400, f"{field} '{path}' is not a directory", field)
    if (p / MANIFEST_FILE).is_file():
        problems = verify_dir(p)
        if problems:
            raise ApiError(
                400,
                f"{field} '{p}' does not match its {MANIFEST_FILE}: {'; '.join(problems)}",
                field,
            )
    return p


def non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an inf, else None."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def read_safetensors(files: list[Path], field: str) -> dict[str, torch.Tensor]:
    """All tensors of ``files``; a file that does not parse or holds NaN/inf is a 400."""
    import safetensors.torch

    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = safetensors.torch.load_file(f)
        except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
            raise ApiError(
                400, f"{field}: '{f}' is not a readable safetensors file: {exc}", field
            ) from exc
        bad = non_finite(tensors)
        if bad is not None:
            raise ApiError(400, f"{field}: tensor '{bad}' in '{f}' has NaN or inf values", field)
        out.update(tensors)
    return out


def load_checked(model_dir: str | Path, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """``load_pretrained`` after the manifest check, refusing a model with non-finite weights."""
    p = checked_folder(model_dir, "MODEL_DIR")
    try:
        model, tokenizer = load_pretrained(p, device)
    except (FileNotFoundError, ValueError):
        raise
    except Exception as exc:  # truncated safetensors, bad config.json, ...
        raise ValueError(f"cannot load MODEL_DIR '{p}': {type(exc).__name__}: {exc}") from exc
    bad = non_finite(model.state_dict())
    if bad is not None:
        raise ValueError(f"MODEL_DIR '{p}': weight '{bad}' has NaN or inf values")
    return model, tokenizer


# -- the model host -------------------------------------------------------------------------


class ModelHost:
    """Owns the engine; every call runs under one lock so weights never change mid-batch."""

    def __init__(
        self, model_dir: str | Path, served_name: str, device: torch.device, seed: int = 0
    ) -> None:
        model, tokenizer = load_checked(model_dir, device)
        self.model_dir = str(model_dir)
        self.served_name = served_name
        self.tokenizer = tokenizer
        self.vision = vision_of(tokenizer)  # a VLM's image side (None: a text model)
        self.engine = TorchEngine(model, tokenizer.pad_token_id, seed=seed, vision=self.vision)
        self.adapters: dict[str, str] = {}
        self.weight_version: str | None = None
        text = model.config.get_text_config()  # a VLM's language model holds these
        self.max_model_len = int(getattr(text, "max_position_embeddings", 0) or 0)
        self.vocab_size = int(text.vocab_size)
        self.vocab = Vocab(tokenizer, self.vocab_size, self.max_model_len)
        self._lock = threading.Lock()

    def check_model(self, name: str | None) -> str:
        if name is None or name == self.served_name:
            return self.served_name
        if name in self.adapters:
            return name
        known = ", ".join([self.served_name, *self.adapters])
        raise ApiError(404, f"The model `{name}` does not exist (served: {known}).", "model")

    def generate(
        self, model_name: str, reqs: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        with self._lock:
            model = self.engine.model
            self.engine.reset_cache()  # a cache is only valid for the weights that made it
            if model_name == self.served_name:
                if self.adapters:
                    with model.disable_adapter():
                        return self.engine.generate(reqs, params)
                return self.engine.generate(reqs, params)
            model.set_adapter(model_name)
            return self.engine.generate(reqs, params)

    def prompt_logprobs(self, model_name: str, ids: list[int], k: int) -> list[PromptToken]:
        """The log-probs of a prompt's tokens under ``model_name`` (base or adapter)."""
        with self._lock:
            model = self.engine.model
            if model_name != self.served_name:
                model.set_adapter(model_name)
                return prompt_table(model, ids, k)
            if self.adapters:
                with model.disable_adapter():
                    return prompt_table(model, ids, k)
            return prompt_table(model, ids, k)

    def load_lora(self, name: str, path: str) -> None:
        from gyre.models.lora import ADAPTER_CONFIG, is_adapter_dir, load_adapter_into

        folder = checked_folder(path, "lora_path")
        if not is_adapter_dir(folder):
            raise ApiError(
                400,
                f"lora_path '{path}' is not a peft adapter folder (no {ADAPTER_CONFIG})",
                "lora_path",
            )
        # Read (and so check) the adapter's files before the model is touched: peft injects its
        # layers into the base model before it reads the weights.
        read_safetensors(sorted(folder.glob("*.safetensors")), "lora_path")
        with self._lock:
            if name == self.served_name or name in self.adapters:
                raise ApiError(400, f"The lora adapter '{name}' has already been loaded.")
            try:
                self.engine.model = load_adapter_into(self.engine.model, folder, name).eval()
            except Exception as exc:
                raise ApiError(
                    400, f"cannot load adapter from '{path}': {exc}", "lora_path"
                ) from exc
            self.adapters[name] = path
            self.engine.reset_cache()
            mine = {k: v for k, v in self.engine.model.state_dict().items() if f".{name}." in k}
            bad = non_finite(mine)
            if bad is not None:  # e.g. an adapter_model.bin: only visible once loaded
                self._unload(name)
                raise ApiError(400, f"lora_path: tensor '{bad}' has NaN or inf values", "lora_path")

    def unload_lora(self, name: str) -> None:
        with self._lock:
            self._unload(name)

    def _unload(self, name: str) -> None:
        if name not in self.adapters:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        del self.adapters[name]
        model = self.engine.model
        if self.adapters:
            model.delete_adapter(name)
        else:  # last adapter gone: take the LoRA layers out of the base model again
            self.engine.model = model.unload().eval()
        self.engine.reset_cache()

    def update_weights(self, path: str, version: str | None) -> str:
        folder = checked_folder(path, "model_path")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ApiError(400, f"no *.safetensors weights in model_path '{path}'", "model_path")
        loaded = read_safetensors(files, "model_path")
        with self._lock:
            own = self.engine.model.state_dict()
            if self.vision is not None and any(self._own_key(k, own) is None for k in loaded):
                loaded = checkpoint_state(folder)  # a VLM folder holds the checkpoint's names
            target: dict[str, torch.Tensor] = {}
            for key, tensor in loaded.items():
                name = self._own_key(key, own)
                if name is None:
                    raise ApiError(
                        400, f"weight '{key}' in '{path}' is not in the served model", "model_path"
                    )
                if own[name].shape != tensor.shape:
                    raise ApiError(
                        400,
                        f"weight '{key}' has shape {tuple(tensor.shape)}, the served model "
                        f"{tuple(own[name].shape)}",
                        "model_path",
                    )
                target[name] = tensor
            self.engine.load_weights(target, self.engine.version + 1)
            self.weight_version = version
        return f"loaded {len(target)} tensors from {path}"

    def _own_key(self, key: str, own: dict[str, torch.Tensor]) -> str | None:
        # With adapters loaded the base weights sit under peft's prefix and `base_layer`.
        candidates = [key]
        if self.adapters:
            wrapped = f"base_model.model.{key}"
            stem, _, leaf = wrapped.rpartition(".")
            candidates += [wrapped, f"{stem}.base_layer.{leaf}"]
        return next((c for c in candidates if c in own), None)


# -- batching queue -------------------------------------------------------------------------


@dataclass
class _Pending:
    key: tuple[Any, ...]
    model: str
    reqs: list[GenerationRequest]
    params: SamplingParams
    future: asyncio.Future


class Batcher:
    """Gathers concurrent requests for up to ``wait_s`` and runs them as few engine batches.

    Two single threads keep the event loop free: ``executor`` runs the engine (every batch and
    weight change, in order) and ``prep`` runs tokenization, decoding and body validation (one
    at a time: a tokenizer is not safe to share between threads, and one several-MiB request
    at a time bounds the memory it takes).
    """

    def __init__(self, host: ModelHost, max_batch: int = 64, wait_s: float = 0.005) -> None:
        self.host, self.max_batch, self.wait_s = host, max_batch, wait_s
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-engine")
        self.prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-prep")
        self.stats = {"batches": 0, "requests": 0, "prompts": 0, "max_batch_prompts": 0}
        self._seeded = itertools.count()

    async def submit(
        self, model: str, reqs: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        # A seeded request runs alone: its samples then do not depend on what it shared a batch
        # with.
        key = (model, params, next(self._seeded) if params.seed is not None else None)
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put(_Pending(key, model, reqs, params, fut))
        return await fut

    async def run_in_engine(self, fn: Any, *args: Any) -> Any:
        """Run a weight-changing call on the engine thread, between batches."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run_in_prep(self, fn: Any, *args: Any) -> Any:
        """Run tokenizer work (or other CPU-heavy request handling) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, *args)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.prep.shutdown(wait=False, cancel_futures=True)

    async def loop(self) -> None:
        while True:
            first = await self.queue.get()
            items = [first]
            size = len(first.reqs)
            deadline = time.monotonic() + self.wait_s
            while size < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self.queue.get(), left)
                except TimeoutError:
                    break
                items.append(item)
                size += len(item.reqs)
            groups: dict[tuple[Any, ...], list[_Pending]] = {}
            for it in items:
                groups.setdefault(it.key, []).append(it)
            for group in groups.values():
                await self._run_group(group)

    async def _run_group(self, group: list[_Pending]) -> None:
        reqs = [r for it in group for r in it.reqs]
        head = group[0]
        try:
            outs = await self.run_in_engine(self.host.generate, head.model, reqs, head.params)
        except Exception as exc:
            for it in group:
                if not it.future.done():
                    it.future.set_exception(exc)
            return
        self.stats["batches"] += 1
        self.stats["requests"] += len(group)
        self.stats["prompts"] += len(reqs)
        self.stats["max_batch_prompts"] = max(self.stats["max_batch_prompts"], len(reqs))
        i = 0
        for it in group:
            n = len(it.reqs)
            if not it.future.done():
                it.future.set_result(outs[i : i + n])
            i += n
