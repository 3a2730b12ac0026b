"""Character tokenizer and the tiny Llama: build, save, load."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gyre.config import ModelConfig
from gyre.envs.arithmetic import ArithmeticEnv
from gyre.envs.maze import MazeEnv
from gyre.models.build import (
    CHARSET,
    build_char_tokenizer,
    build_tiny_model,
    count_parameters,
    create_tiny_checkpoint,
    load_pretrained,
)


def _sample_texts() -> list[str]:
    texts = []
    for view in (0, 2):
        env = MazeEnv(view=view)
        for seed in range(4):
            texts.append(env.reset(seed))
            texts.append(env.step("r")[0])
    arith = ArithmeticEnv(ops="+-*")
    texts += [arith.reset(s) for s in range(4)]
    texts += ["u\n", "left\n", "\n\n", " ", CHARSET]
    return texts


# -- tokenizer --------------------------------------------------------------------------------
def test_round_trip_one_token_per_char(tokenizer):
    for text in _sample_texts():
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == len(text), repr(text)
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text


def test_newline_is_its_own_token(tokenizer):
    nl = tokenizer.convert_tokens_to_ids("\n")
    assert nl != tokenizer.unk_token_id
    ids = tokenizer.encode("#.\n.A", add_special_tokens=False)
    assert ids[2] == nl and ids.count(nl) == 1


def test_special_tokens_distinct(tokenizer):
    special = [
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.unk_token_id,
    ]
    assert None not in special and len(set(special)) == 4
    assert len(tokenizer) == len(CHARSET) + 4


def test_unknown_character_maps_to_unk(tokenizer):
    assert tokenizer.encode("é", add_special_tokens=False) == [tokenizer.unk_token_id]


def test_tokenizer_save_load_identical(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in _sample_texts():
        assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(
            text, add_special_tokens=False
        )
        assert loaded.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id"):
        assert getattr(loaded, name) == getattr(tokenizer, name)


def test_build_is_fresh_each_time():
    a, b = build_char_tokenizer(), build_char_tokenizer()
    assert a.get_vocab() == b.get_vocab()


# -- tiny model -------------------------------------------------------------------------------
def test_default_param_count_in_range(tokenizer):
    n = count_parameters(build_tiny_model(ModelConfig(), tokenizer, seed=0))
    assert 500_000 <= n <= 2_000_000


def test_tiny_model_seeded(tokenizer, tiny_cfg):
    cfg = tiny_cfg
    a = build_tiny_model(cfg, tokenizer, seed=1)
    b = build_tiny_model(cfg, tokenizer, seed=1)
    c = build_tiny_model(cfg, tokenizer, seed=2)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert any(
        not torch.equal(pa, pc)
        for pa, pc in zip(a.state_dict().values(), c.state_dict().values(), strict=True)
    )


def test_build_does_not_disturb_global_rng(tokenizer, tiny_cfg):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tiny_cfg, tokenizer, seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_checkpoint_round_trip(tokenizer, tiny_cfg, tmp_path):
    cfg = tiny_cfg
    out = create_tiny_checkpoint(cfg, tmp_path / "tiny", seed=3)
    assert (out / "config.json").is_file()
    model, tok = load_pretrained(out, torch.device("cpu"))
    reference = build_tiny_model(cfg, tokenizer, seed=3)
    ref_sd = reference.state_dict()
    sd = model.state_dict()
    assert set(sd) == set(ref_sd)
    for name, tensor in sd.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ref_sd[name]), name
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 2
    assert tok.pad_token_id is not None
    text = MazeEnv().reset(0)
    assert tok.encode(text, add_special_tokens=False) == tokenizer.encode(
        text, add_special_tokens=False
    )
    x = torch.tensor([[tok.bos_token_id, *tok.encode(text, add_special_tokens=False)]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, reference(input_ids=x).logits)
    # a plain transformers load sees the same weights
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, ref_sd[name]), name


def test_load_without_config_names_path(tmp_path):
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as info:
        load_pretrained(empty, torch.device("cpu"))
    assert str(empty) in str(info.value)
    missing = tmp_path / "does_not_exist"
    with pytest.raises(FileNotFoundError, match="does_not_exist"):
        load_pretrained(missing, torch.device("cpu"))
