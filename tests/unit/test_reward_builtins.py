"""Built-in rewards: math-verify answers by hand, and the reward-model scorer on a tiny
sequence classifier built here with save_pretrained (no download)."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig

from gyre.config import RewardConfig
from gyre.models.build import build_char_tokenizer
from gyre.rewards import RewardBatch, Rewarder
from gyre.rewards.math_answer import math_answer
from gyre.rewards.reward_model import load_reward_model, reward_model

pytest.importorskip("math_verify")


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("\\boxed{1/2}", "0.5", 1.0),
        ("0.5", "\\boxed{1/2}", 1.0),
        ("$\\frac{1}{2}$", "1/2", 1.0),
        ("The answer is 42.", "42", 1.0),
        ("so x = \\boxed{7}\n", "7", 1.0),
        ("\\boxed{0.33}", "1/3", 0.0),
        ("41", "42", 0.0),
        ("no number here", "42", 0.0),
        ("", "3", 0.0),
    ],
)
def test_math_answer_hand_cases(completion, reference, expected):
    assert math_answer(["q"], [completion], answer=[reference]) == [expected]


def test_math_answer_batch_custom_field_and_missing_reference():
    out = math_answer(
        ["a", "b", "c"], ["6", "7", "8"], answer_field="solution", solution=["6", "6", None]
    )
    assert out == [1.0, 0.0, 0.0]  # a row without a reference scores 'wrong', never raises
    with pytest.raises(ValueError, match="no column 'answer'"):
        math_answer(["a"], ["6"], solution=["6"])


def test_math_answer_without_the_package_says_which_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install 'gyre\[math\]'"):
        math_answer(["q"], ["1"], answer=["1"])


def test_math_answer_as_a_configured_term():
    cfg = RewardConfig.model_validate(
        {"functions": [{"fn": "gyre.rewards.math_answer:math_answer"}], "env_weight": 0.0}
    )
    batch = RewardBatch(
        ["q", "q"], ["\\boxed{3}", "4"], {"env_reward": [1.0, 1.0], "answer": ["3", "3"]}
    )
    totals, values, _ = Rewarder(cfg).score_batch(batch)
    assert values["math_answer"] == [1.0, 0.0] and totals == [1.0, 0.0]


# -- reward model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A 1-layer Llama sequence classifier (1 label) and the char tokenizer, saved locally."""
    tok = build_char_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    from transformers import LlamaForSequenceClassification

    out = tmp_path_factory.mktemp("rm")
    LlamaForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


PROMPTS = ["1+1=", "What is 3*3? ", "x"]
COMPLETIONS = ["2", "nine, I think", "a much longer completion than the others"]


def test_reward_model_scores_match_a_direct_forward(rm_dir):
    scores = reward_model(PROMPTS, COMPLETIONS, path=str(rm_dir), batch_size=2)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tok = build_char_tokenizer()
    for p, c, s in zip(PROMPTS, COMPLETIONS, scores, strict=True):
        ids = tok(p + c, return_tensors="pt")
        with torch.no_grad():
            ref = model(**ids).logits[0, 0].item()
        assert s == pytest.approx(ref, abs=1e-5)  # right padding does not change a score
    assert len(set(scores)) == 3  # distinct texts, distinct scores: the model really ran


def test_reward_model_batch_size_does_not_change_scores(rm_dir):
    a = reward_model(PROMPTS, COMPLETIONS, path=str(rm_dir), batch_size=1)
    b = reward_model(PROMPTS, COMPLETIONS, path=str(rm_dir), batch_size=3)
    assert a == pytest.approx(b, abs=1e-5)


def test_reward_model_through_the_config(rm_dir):
    cfg = RewardConfig.model_validate(
        {
            "functions": [
                {
                    "fn": "gyre.rewards.reward_model:reward_model",
                    "name": "rm",
                    "weight": 2.0,
                    "kwargs": {"path": str(rm_dir), "device": "cpu", "batch_size": 2},
                }
            ],
            "env_weight": 0.0,
        }
    )
    batch = RewardBatch(PROMPTS, COMPLETIONS, {"env_reward": [0.0] * 3})
    totals, values, _ = Rewarder(cfg).score_batch(batch)
    direct = reward_model(PROMPTS, COMPLETIONS, path=str(rm_dir))
    assert values["rm"] == pytest.approx(direct)
    assert totals == pytest.approx([2 * v for v in direct])


def test_reward_model_errors(rm_dir, tmp_path):
    with pytest.raises(ValueError, match=r"set kwargs\.path"):
        reward_model(["a"], ["b"])
    with pytest.raises(ValueError, match="cannot load a sequence-classification model"):
        reward_model(["a"], ["b"], path=str(tmp_path))
    with pytest.raises(ValueError, match="label 1 out of range for 1 labels"):
        reward_model(["a"], ["b"], path=str(rm_dir), label=1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            reward_model(["a"], ["b"], path=str(rm_dir), device="cuda")


def test_reward_model_is_loaded_once(rm_dir):
    assert load_reward_model(str(rm_dir)) is load_reward_model(str(rm_dir))


def test_reward_model_prob_and_chat_template(tmp_path):
    """A 3-class head: ``prob`` is the softmax of ``label``; ``chat_template`` scores the text
    the model's own template renders."""
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_labels=3,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(1)
    from transformers import LlamaForSequenceClassification

    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()

    def direct(text: str) -> torch.Tensor:
        with torch.no_grad():
            return model(**tok(text, return_tensors="pt")).logits[0]

    probs = reward_model(["1+1="], ["2"], path=str(tmp_path), label=2, prob=True)
    assert probs[0] == pytest.approx(direct("1+1=2").softmax(-1)[2].item(), abs=1e-6)
    chat = reward_model(["1+1="], ["2"], path=str(tmp_path), label=1, chat_template=True)
    assert chat[0] == pytest.approx(direct("u:1+1=\na:2\n")[1].item(), abs=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reward_model_on_cuda_matches_cpu(rm_dir):
    cpu = reward_model(PROMPTS, COMPLETIONS, path=str(rm_dir), device="cpu")
    gpu = reward_model(PROMPTS, COMPLETIONS, path=str(rm_dir), device="cuda", batch_size=2)
    assert gpu == pytest.approx(cpu, abs=1e-3)
