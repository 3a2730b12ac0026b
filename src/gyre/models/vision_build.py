"""Tiny vision-language models built on the spot: a Qwen2.5-VL and an Idefics3 (SmolVLM's
architecture), each with a processor made locally.

Like the text default (:mod:`gyre.models.build`), nothing is downloaded: the config, weights,
byte-level tokenizer (every byte one token, plus the model's special tokens), chat template and
image processor are created here, written with ``save_pretrained`` and read back through
``AutoModelForImageTextToText`` / ``AutoProcessor`` (:func:`gyre.models.vision.load_vlm`), the
path a real checkpoint takes.

Shapes (the defaults, docs/vision.md): Qwen2.5-VL with an 8-pixel patch and a 2x2 spatial
merge, so one image token covers 16x16 pixels; a 2-layer, 32-wide vision tower and a 2-layer,
64-wide language model (about 0.2M parameters). Idefics3 with a 16-pixel patch on a 32-pixel
image (no image splitting) and a 2x2 pixel-shuffle: one image token per image.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2.5-VL's own chat template (tokenizer_config.json of Qwen/Qwen2.5-VL-*-Instruct), without
# the video branch and vision ids: a content is a string or a list of image / text parts.
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

IDEFICS3_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
]
# SmolVLM-Instruct's template: "User:<image>text<end_of_utterance>\nAssistant:".
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'] is string %}: {{ message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

VLMKind = Literal["qwen2_5_vl", "qwen3_vl", "idefics3"]


@dataclass(frozen=True)
class LMSize:
    """The tiny VLM's language model (``model.tiny_vlm``; the defaults are the built-in ones)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    patch_size: int = 0  # the vision tower's patch; 0: the kind's own (Qwen2.5-VL 8, Qwen3-VL 16)
    vision_hidden_size: int = 0  # the tower's width (its MLP 2x); 0: the built-in 32
    position_grid: int = 0  # Qwen3-VL: side of the tower's learned position grid; 0: 8

    def tower(self) -> dict[str, Any]:
        """The vision tower's width, heads and MLP (``vision_hidden_size``; default 32)."""
        width = self.vision_hidden_size or 32
        return dict(hidden_size=width, intermediate_size=2 * width, num_heads=max(2, width // 32))

    def text_config(self) -> dict[str, Any]:
        return dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def mrope_section(self) -> list[int]:
        """(t, h, w) rotary pairs of a head, split as Qwen2.5-VL does (16, 24, 24 of 64)."""
        half = self.head_dim // 2
        t = half // 4
        h = (half - t) // 2
        return [t, h, half - t - h]


def byte_tokenizer(specials: list[str], eos: str, template: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE without merges (each byte one token) plus ``specials`` as single
    tokens, with a chat template: a real GPT-2 style tokenizer, built without training."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": specials})
    fast.chat_template = template
    return fast


def _qwen_parts(patch_size: int) -> tuple[PreTrainedTokenizerFast, dict[str, int], Any]:
    """The Qwen-VL families' shared pieces: the byte tokenizer with their special tokens and
    template, those tokens' ids, and the image processor (2x2 merge) for ``patch_size``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = byte_tokenizer(QWEN_SPECIALS, "<|im_end|>", QWEN_VL_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256},
    )
    return tok, ids, image_processor


def _seeded(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Draw the language model's weights again from ``seed`` alone, so that they do not depend
    on how many draws the vision tower (built first) took: two tiny Qwen3-VLs with the same
    ``run.seed`` and language model but other towers (``patch_size``) start from the same
    language model. The SFT outcome of these tiny models depends strongly on that draw
    (docs/results/visual-maze.md)."""
    init = model._init_weights
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.no_grad():
            for module in model.model.language_model.modules():
                init(module)
    return model


def _qwen(seed: int, lm: LMSize) -> tuple[torch.nn.Module, PreTrainedTokenizerFast, Any]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    # 8-pixel patches, 2x2 merge: images are resized to multiples of 16 pixels, between 2x2
    # and 16x16 image tokens (64 x 64 to 256 x 256 pixels' worth).
    patch = lm.patch_size or 8
    tok, ids, image_processor = _qwen_parts(patch_size=patch)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            **lm.text_config(),
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": lm.mrope_section(),
            },
            tie_word_embeddings=True,
            pad_token_id=tok.pad_token_id,
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,
        ),
        vision_config=dict(
            depth=2,
            **lm.tower(),
            patch_size=patch,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=lm.hidden_size,
            window_size=4 * patch,
            fullatt_block_indexes=[1],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    # Not redrawn (_seeded): the Qwen2.5-VL default keeps the draw its tests and examples were
    # measured with (these tiny models' SFT outcome depends on the draw).
    return model, tok, image_processor


def _qwen3(seed: int, lm: LMSize) -> tuple[torch.nn.Module, PreTrainedTokenizerFast, Any]:
    """Qwen3-VL: 16-pixel patches (its native size; ``lm.patch_size`` to change), 2x2 merge,
    deepstack on vision layer 0."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    patch = lm.patch_size or 16
    tok, ids, image_processor = _qwen_parts(patch_size=patch)
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            **lm.text_config(),
            head_dim=lm.head_dim,
            max_position_embeddings=4096,
            pad_token_id=tok.pad_token_id,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": lm.mrope_section(),
                "mrope_interleaved": True,
            },
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=2,
            **lm.tower(),
            patch_size=patch,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=lm.hidden_size,
            num_position_embeddings=(lm.position_grid or 8) ** 2,
            deepstack_visual_indexes=[0],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config)
    return _seeded(model, seed), tok, image_processor


def _idefics3(seed: int, lm: LMSize) -> tuple[torch.nn.Module, PreTrainedTokenizerFast, Any]:
    for key in ("patch_size", "vision_hidden_size", "position_grid"):
        if getattr(lm, key):
            raise ValueError(f"model.tiny_vlm.{key} applies to the Qwen-VL kinds, not idefics3")
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    tok = byte_tokenizer(IDEFICS3_SPECIALS, "<end_of_utterance>", IDEFICS3_TEMPLATE)
    # One 32x32 tile per image (no splitting): 2x2 patches of 16, pixel-shuffled 2x2 -> 1 token.
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": 32},
        max_image_size={"longest_edge": 32},
    )
    config = Idefics3Config(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=16,
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=len(tok),
            **lm.text_config(),
            max_position_embeddings=4096,
            pad_token_id=tok.pad_token_id,
            tie_word_embeddings=True,
        ),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config)
    return model, tok, image_processor


def create_tiny_vlm(
    kind: VLMKind, out_dir: str | Path, seed: int, lm: LMSize | None = None
) -> Path:
    """Build the tiny ``kind`` VLM, its tokenizer and image processor; save them as one Hugging
    Face folder (loaded back by :func:`gyre.models.vision.load_vlm`). ``lm``: the language
    model's size (``model.tiny_vlm``; default the built-in 2 layers x 64)."""
    from gyre.models.vision import processor_from_parts

    builders = {"qwen2_5_vl": _qwen, "qwen3_vl": _qwen3, "idefics3": _idefics3}
    if kind not in builders:
        raise ValueError(f"model.kind={kind!r}: tiny VLMs are {sorted(builders)}")
    model, tok, image_processor = builders[kind](seed, lm or LMSize())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor_from_parts(model.config, tok, image_processor).save(out)
    return out
