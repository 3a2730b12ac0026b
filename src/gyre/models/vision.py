"""Vision-language models: loading, image placeholder expansion, pixel inputs, positions.

A VLM sees an image as a run of *image tokens* in its ids (Qwen2.5-VL: ``<|image_pad|>`` x
(grid_t x grid_h x grid_w / merge^2); Idefics3 / SmolVLM: ``<image>`` x image_seq_len inside
``<fake_token_around_image>`` markers) whose embeddings the model replaces with the vision
tower's features. :class:`VisionIO` is the one place that turns images into those ids and
tensors, so the engine (sampling) and the trainer (scoring) build *the same* inputs:

- :meth:`VisionIO.expand`: rendered text with one placeholder per image -> ids, each image's
  placeholder expanded exactly once (by the model's processor when it loads, else by the same
  rule for Qwen-VL folders -- see :func:`load_vision`);
- :meth:`VisionIO.inputs`: the images of some rows -> the model's pixel keyword arguments
  (``pixel_values`` + ``image_grid_thw``, or ``pixel_values`` + ``pixel_attention_mask``);
- :meth:`VisionIO.positions`: Qwen-VL's 3-D rotary positions (M-RoPE) of a sequence, computed
  from its ids and image grids the way ``get_rope_index`` does (tested equal), so a row can be
  prefilled in pieces (turn by turn, with a KV cache) and still get the positions the trainer
  uses for the whole sequence.

Images travel as HxWx3 uint8 arrays (``Trajectory.images``, ``GenerationRequest.images``):
picklable, small, and re-processed to bit-identical pixel values anywhere.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

_log = logging.getLogger("gyre.models.vision")
QWEN_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
IDEFICS_TYPES = ("idefics3", "smolvlm")
_ATTR = "_gyre_vision"  # the tokenizer attribute that carries a VLM's VisionIO
# Processed images kept per VisionIO, bounded by their tensors' bytes (an 84-px image is about
# 100 KB of fp32 patches, a 288-px one 2 MB: a count bound let the cache reach gigabytes).
_CACHE_BYTES = 256 * 2**20


def is_vlm_folder(path: str | Path) -> bool:
    """A model folder whose ``config.json`` has a ``vision_config`` (an image-text-to-text
    model, loaded with ``AutoModelForImageTextToText``)."""
    p = Path(path) / "config.json"
    if not p.is_file():
        return False
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return False  # gyre.models.build.check_model_config reports it
    return isinstance(data, dict) and "vision_config" in data


def to_image(image: Any, where: str = "image") -> np.ndarray:
    """A PIL image or an HxWx3 uint8 array -> a contiguous HxWx3 uint8 array (one-line error
    naming ``where`` otherwise)."""
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL.Image.Image
        image = np.asarray(image.convert("RGB"))
    if not isinstance(image, np.ndarray):
        raise ValueError(
            f"{where}: expected a PIL image or an HxWx3 uint8 array, got {type(image).__name__}"
        )
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or 0 in image.shape:
        raise ValueError(
            f"{where}: expected an HxWx3 uint8 array, got {image.dtype} {tuple(image.shape)}"
        )
    return np.ascontiguousarray(image)


_DATA_URI = "data:image/"
MAX_IMAGE_PIXELS = 1 << 24  # 16.8 MP: a few MiB of PNG can hold a gigapixel image


def _pil(where: str) -> Any:
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError(
            f"{where}: images over HTTP need Pillow: pip install 'gyre[vision]'"
        ) from exc
    return Image


def image_data_uri(image: np.ndarray) -> str:
    """An HxWx3 uint8 array as ``data:image/png;base64,...``: lossless, so the server decodes
    the very pixels (and its image processor the very ``pixel_values``) the trainer uses."""
    import base64
    import io

    buf = io.BytesIO()
    _pil("image_data_uri").fromarray(to_image(image)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def image_from_uri(uri: Any, where: str) -> np.ndarray:
    """A ``data:image/...;base64,...`` URI -> an HxWx3 uint8 array; anything else (a URL, a
    path, bad base64, bytes that are not an image) is a ValueError naming ``where``."""
    import base64
    import binascii
    import io

    if not isinstance(uri, str) or not uri.startswith(_DATA_URI):
        shown = repr(uri)[:60]
        raise ValueError(
            f"{where}: expected a data:image/...;base64,... URI, got {shown} (gyre fetches no "
            "URLs or files)"
        )
    head, sep, data = uri.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ValueError(f"{where}: a data URI must be base64 (data:image/png;base64,...)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{where}: invalid base64 in the data URI ({exc})") from None
    Image = _pil(where)
    try:
        with Image.open(io.BytesIO(raw)) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise ValueError(
                    f"{where}: a {img.width}x{img.height} image is over {MAX_IMAGE_PIXELS} pixels"
                )
            img.load()
            return to_image(img, where)
    except (OSError, Image.DecompressionBombError) as exc:  # UnidentifiedImageError is OSError
        raise ValueError(f"{where}: the data URI is not a readable image ({exc})") from None


def image_key(image: np.ndarray) -> bytes:
    """A content hash of an image (shape + bytes): equal keys, equal pixels."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(image.shape).encode())
    h.update(image.tobytes())
    return h.digest()


def images_in(messages: Sequence[dict[str, Any]], where: str = "message") -> list[np.ndarray]:
    """The images of ``messages``' content parts (``{"type": "image", "image": ...}``), in
    order; a part of another type than image / text is an error naming it."""
    out: list[np.ndarray] = []
    for m, msg in enumerate(messages):
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                out.append(to_image(part.get("image"), f"{where} {m} content[{k}].image"))
            elif kind != "text":
                raise ValueError(
                    f"{where} {m} content[{k}]: a part is "
                    f"{{'type': 'image' | 'text', ...}}, got {part!r:.80}"
                )
    return out


class VisionIO:
    """A VLM's image side (see the module docstring). ``processor``: the model's HF processor
    where it loaded (its ``__call__`` expands placeholders), else None (Qwen-VL rule)."""

    def __init__(
        self, config: Any, tokenizer: Any, image_processor: Any, processor: Any = None
    ) -> None:
        self.model_type = str(config.model_type)
        if self.model_type not in QWEN_TYPES + IDEFICS_TYPES:
            raise ValueError(
                f"VLM model_type {self.model_type!r} is not supported (gyre knows "
                f"{', '.join(QWEN_TYPES + IDEFICS_TYPES)})"
            )
        if processor is None and self.model_type not in QWEN_TYPES:
            raise ValueError(f"{self.model_type}: its AutoProcessor did not load")
        self.qwen = self.model_type in QWEN_TYPES
        self.tokenizer, self.image_processor, self.processor = tokenizer, image_processor, processor
        self.image_token_id = int(config.image_token_id)
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size) if self.qwen else 1
        video = getattr(config, "video_token_id", None)
        self._never = torch.tensor([self.image_token_id] + ([int(video)] if video else []))
        self._cache: dict[bytes, tuple[dict[str, torch.Tensor], int]] = {}
        self._cache_bytes = 0

    # -- one image ----------------------------------------------------------------------------
    def process(self, image: np.ndarray) -> tuple[dict[str, torch.Tensor], int]:
        """(the image's pixel tensors, its number of image tokens), cached by content."""
        key = image_key(image)
        got = self._cache.get(key)
        if got is not None:
            return got
        if self.qwen:
            out = self.image_processor(images=[image], return_tensors="pt")
            grid = out["image_grid_thw"]  # (1, 3)
            tensors = {"pixel_values": out["pixel_values"], "image_grid_thw": grid}
            n = int(grid.prod()) // self.merge**2
        else:
            out = self.image_processor(images=[[image]], return_tensors="pt")
            tensors = {
                "pixel_values": out["pixel_values"][0],  # (tiles, 3, H, W)
                "pixel_attention_mask": out["pixel_attention_mask"][0],
            }
            probe = self.processor(
                text=[self.image_token], images=[[image]], add_special_tokens=False
            )
            n = list(probe["input_ids"][0]).count(self.image_token_id)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self._cache_bytes + size > _CACHE_BYTES:
            self._cache.clear()
            self._cache_bytes = 0
        self._cache[key] = (tensors, n)
        self._cache_bytes += size
        return tensors, n

    def num_tokens(self, image: np.ndarray) -> int:
        return self.process(image)[1]

    # -- ids ----------------------------------------------------------------------------------
    def expand(self, text: str, images: Sequence[np.ndarray], where: str = "turn") -> list[int]:
        """Rendered ``text`` holding one placeholder per image -> ids, each image's placeholder
        expanded once. A placeholder count other than ``len(images)`` is an error."""
        found = text.count(self.image_token)
        if found != len(images):
            raise ValueError(
                f"{where}: the messages hold {len(images)} image(s) but the "
                f"rendered text has {found} {self.image_token} placeholder(s)"
            )
        if not images:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.processor is not None:
            imgs = [list(images)] if not self.qwen else list(images)
            out = self.processor(text=[text], images=imgs, add_special_tokens=False)
            return [int(i) for i in out["input_ids"][0]]
        pieces = text.split(self.image_token)  # Qwen2.5-VL processor's rule
        parts = [pieces[0]]
        for img, piece in zip(images, pieces[1:], strict=True):
            parts.append(self.image_token * self.num_tokens(img) + piece)
        return list(self.tokenizer("".join(parts), add_special_tokens=False)["input_ids"])

    def check(self, ids: Sequence[int], images: Sequence[np.ndarray], where: str) -> None:
        """The image tokens of ``ids`` are exactly what ``images`` need; else a one-line error."""
        have = sum(1 for t in ids if t == self.image_token_id)
        need = sum(self.num_tokens(im) for im in images)
        if have != need:
            raise ValueError(
                f"{where}: {have} image tokens in the ids, but its {len(images)} "
                f"image(s) need {need} (wrong image count?)"
            )

    def images_in_chunk(
        self, fed: Sequence[int], chunk: Sequence[int], images: Sequence[np.ndarray]
    ) -> list[np.ndarray]:
        """The images whose placeholder tokens are in ``chunk`` (fed after ``fed``)."""
        inside = sum(1 for t in chunk if t == self.image_token_id)
        if not inside:  # every decode step: never count the whole row
            return []
        before = sum(1 for t in fed if t == self.image_token_id)
        seen, out = 0, []
        for img in images:
            n = self.num_tokens(img)
            if before <= seen and seen + n <= before + inside:
                out.append(img)
            elif seen < before + inside and seen + n > before:
                raise ValueError("an image's placeholder tokens are split across two prefills")
            seen += n
        if sum(self.num_tokens(i) for i in out) != inside:
            raise ValueError(
                f"{inside} image tokens in a prefill but the request's images do "
                f"not account for them (wrong image count?)"
            )
        return out

    def suppress(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (..., V) with the placeholder tokens at -inf: the policy never samples
        an image token (it would stand for an image that is not there). The engine samples from
        and the trainer scores this same distribution."""
        return logits.index_fill(-1, self._never.to(logits.device), float("-inf"))

    # -- tensors ------------------------------------------------------------------------------
    def inputs(
        self, rows: Sequence[Sequence[np.ndarray]], device: torch.device
    ) -> dict[str, torch.Tensor]:
        """The pixel keyword arguments of a batch whose row b holds ``rows[b]``'s placeholders
        (in order); {} when no row has an image."""
        if not any(rows):
            return {}
        per = [[self.process(im)[0] for im in row] for row in rows]
        if self.qwen:
            flat = [t for row in per for t in row]
            return {
                "pixel_values": torch.cat([t["pixel_values"] for t in flat]).to(device),
                "image_grid_thw": torch.cat([t["image_grid_thw"] for t in flat]).to(device),
            }
        # Idefics3: (B, tiles, 3, H, W), rows padded with all-zero tiles (the model drops them)
        stacks = [torch.cat([t["pixel_values"] for t in row]) if row else None for row in per]
        masks = [
            torch.cat([t["pixel_attention_mask"] for t in row]) if row else None for row in per
        ]
        ref = next(s for s in stacks if s is not None)
        ref_m = next(m for m in masks if m is not None)
        n = max(s.shape[0] if s is not None else 0 for s in stacks)
        pv = ref.new_zeros((len(rows), n, *ref.shape[1:]))
        pm = ref_m.new_zeros((len(rows), n, *ref_m.shape[1:]))
        for b, (s, m) in enumerate(zip(stacks, masks, strict=True)):
            if s is not None:
                pv[b, : s.shape[0]], pm[b, : m.shape[0]] = s, m
        return {"pixel_values": pv.to(device), "pixel_attention_mask": pm.to(device)}

    def positions(self, ids: Sequence[int], images: Sequence[np.ndarray]) -> np.ndarray | None:
        """Qwen-VL M-RoPE positions (3, L) of ``ids`` (None: plain 1-D positions 0..L-1).

        Text tokens count up from the position after everything before them (equal in all three
        axes); an image of llm grid (t, h, w) takes (t_i, h_i, w_i) + start for its tokens in
        raster order, and the next token starts at start + max(h, w) -- ``get_rope_index``.
        """
        if not self.qwen:
            return None
        arr = np.asarray(ids, dtype=np.int64)
        out = np.empty((3, len(arr)), dtype=np.int64)
        it = iter(images)
        cur, i, L = 0, 0, len(arr)
        img_pos = np.flatnonzero(arr == self.image_token_id)
        while i < L:
            nxt = img_pos[np.searchsorted(img_pos, i)] if len(img_pos) and img_pos[-1] >= i else L
            out[:, i:nxt] = np.arange(cur, cur + nxt - i)[None]
            cur += nxt - i
            i = nxt
            if i >= L:
                break
            img = next(it, None)
            if img is None:
                raise ValueError("more image placeholders in the ids than images")
            grid = self.process(img)[0]["image_grid_thw"][0].tolist()
            t, h, w = grid[0], grid[1] // self.merge, grid[2] // self.merge
            n = t * h * w
            if i + n > L or not (arr[i : i + n] == self.image_token_id).all():
                raise ValueError(f"an image needs {n} consecutive placeholder tokens at {i}")
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
            out[:, i : i + n] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + cur
            cur += max(h, w)
            i += n
        return out

    def save(self, out: str | Path) -> None:
        """Write the processor (or its image processor + tokenizer) into ``out``."""
        if self.processor is not None:
            self.processor.save_pretrained(out)
        else:
            self.image_processor.save_pretrained(out)
        self.tokenizer.save_pretrained(out)


def attach(tokenizer: Any, vision: VisionIO) -> Any:
    """Mark ``tokenizer`` as a VLM's: :func:`vision_of` returns ``vision`` for it."""
    setattr(tokenizer, _ATTR, vision)
    return tokenizer


def vision_of(tokenizer: Any) -> VisionIO | None:
    """The VisionIO of a VLM's tokenizer (from :func:`load_vlm`), None for a text model's."""
    return getattr(tokenizer, _ATTR, None)


def save_tokenizer(tokenizer: Any, out: str | Path) -> None:
    """``tokenizer.save_pretrained``, plus the image processor for a VLM's tokenizer."""
    vision = vision_of(tokenizer)
    if vision is not None:
        vision.save(out)
    else:
        tokenizer.save_pretrained(out)


def processor_from_parts(config: Any, tokenizer: Any, image_processor: Any) -> VisionIO:
    """A VisionIO over a locally built tokenizer and image processor, with the model's HF
    processor class where it can be built here."""
    processor = None
    try:
        if config.model_type in IDEFICS_TYPES:
            from transformers import Idefics3Processor

            vc = config.vision_config
            seq = (vc.image_size // vc.patch_size) ** 2 // config.scale_factor**2
            processor = Idefics3Processor(
                image_processor=image_processor,
                tokenizer=tokenizer,
                image_seq_len=seq,
                chat_template=tokenizer.chat_template,
            )
        else:
            import transformers  # the Qwen-VL processors' video processor needs torchvision

            names = {
                "qwen2_vl": "Qwen2VLProcessor",
                "qwen2_5_vl": "Qwen2_5_VLProcessor",
                "qwen3_vl": "Qwen3VLProcessor",
            }
            processor = getattr(transformers, names[config.model_type])(
                image_processor=image_processor,
                tokenizer=tokenizer,
                chat_template=tokenizer.chat_template,
            )
    except (ValueError, TypeError, AttributeError, ImportError) as exc:
        if config.model_type in IDEFICS_TYPES:
            raise
        _no_processor(config.model_type, exc)
    return VisionIO(config, tokenizer, image_processor, processor)


_warned: set[str] = set()


def _no_processor(model_type: str, exc: BaseException) -> None:
    if model_type in _warned:
        return
    _warned.add(model_type)
    why = "torchvision is not installed" if importlib.util.find_spec("torchvision") is None else exc
    _log.warning(
        "%s: AutoProcessor cannot be built (%s; its video processor needs it); using "
        "its image processor and tokenizer, with the Qwen-VL placeholder rule",
        model_type,
        why,
    )


def load_vision(path: str | Path, config: Any) -> tuple[VisionIO, Any]:
    """(VisionIO, tokenizer) of a VLM folder, through ``AutoProcessor``; a Qwen-VL folder whose
    processor cannot load without torchvision falls back to ``AutoImageProcessor`` +
    ``AutoTokenizer`` (logged once)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    p = Path(path)
    try:
        processor = AutoProcessor.from_pretrained(p)
        tokenizer, image_processor = processor.tokenizer, processor.image_processor
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = getattr(processor, "chat_template", None)
    except (ValueError, TypeError, AttributeError, ImportError, OSError) as exc:
        if config.model_type not in QWEN_TYPES:
            raise ValueError(f"model.path '{p}': AutoProcessor failed: {exc}") from exc
        _no_processor(config.model_type, exc)
        processor = None
        tokenizer = AutoTokenizer.from_pretrained(p)
        image_processor = AutoImageProcessor.from_pretrained(p)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    vision = VisionIO(config, tokenizer, image_processor, processor)
    return vision, attach(tokenizer, vision)


def load_vlm(path: str | Path, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """A VLM folder -> (model in fp32 on ``device``, tokenizer carrying its VisionIO)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(Path(path), dtype=torch.float32)
    _, tokenizer = load_vision(path, model.config)
    return model.to(device), tokenizer


def checkpoint_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict (the model's own key names, fp32, CPU) of a VLM folder. VLM folders are
    written with the checkpoint's key names (Qwen-VL: ``visual.``, ``model.layers.``), which
    transformers maps on load: load them the same way."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(Path(path), dtype=torch.float32)
    return dict(model.state_dict())


def vision_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The vision tower and projector of a VLM (what LoRA leaves out and training freezes)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", base)
    names = ("visual", "vision_model", "vision_tower", "connector", "multi_modal_projector")
    return [
        getattr(inner, n) for n in names if isinstance(getattr(inner, n, None), torch.nn.Module)
    ]


def freeze_vision(model: torch.nn.Module) -> int:
    """Stop gradients into the vision tower and projector; returns the parameters frozen."""
    n = 0
    for mod in vision_modules(model):
        for p in mod.parameters():
            p.requires_grad_(False)
            n += p.numel()
    return n
