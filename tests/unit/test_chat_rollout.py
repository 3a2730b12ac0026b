"""Message-mode rollouts: chat templates, loss masks, drift, step-wise samples, tool calls."""

from __future__ import annotations

import logging

import pytest
import torch

from chat_helpers import AddEnv, ScriptedEngine, build_chat_model, build_chat_tokenizer
from gyre.algos.advantages import grpo_advantages
from gyre.config import SandboxConfig
from gyre.engines import TorchEngine
from gyre.rollout.chat import ChatMode, ChatTemplate
from gyre.rollout.episodes import run_episodes
from gyre.rollout.tools import (
    HermesParser,
    Toolbox,
    ToolCall,
    ToolEnv,
    ToolError,
    calculator_tool,
    message_metrics,
    python_tool,
    safe_eval,
)
from gyre.trainer.stepwise import episode_advantages, expand_steps
from gyre.types import SamplingParams
from helpers import RecordingEngine

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 30"}}\n</tool_call>'


@pytest.fixture(scope="module")
def toks():
    return {k: build_chat_tokenizer(k) for k in ("chatml", "chatml_strip_think", "llama3")}


def _toolbox() -> Toolbox:
    return Toolbox({"calculator": calculator_tool()}, HermesParser())


def _replay(make_env, seed: int, replies: list[str]) -> list[dict]:
    """The conversation an episode with these replies has (assistant contents = replies)."""
    env = make_env()
    conv = list(env.reset(seed))
    for reply in replies:
        conv.append({"role": "assistant", "content": reply})
        new, _, done, _ = env.step(reply)
        if done:
            break
        conv.extend(new)
    return conv


# -- loss masks with a real (random) model -------------------------------------------------------
@pytest.mark.parametrize(("kind", "arch"), [("chatml", "qwen2"), ("llama3", "llama")])
def test_mask_covers_exactly_the_sampled_ids(toks, kind, arch):
    tok = toks[kind]
    box = _toolbox() if kind == "chatml" else None
    tpl = ChatTemplate(tok, box.schemas if box else None)
    inner = AddEnv(follow_ups=2)
    make_env = (lambda: ToolEnv(AddEnv(2), box)) if box else (lambda: inner.__class__(2))
    engine = RecordingEngine(TorchEngine(build_chat_model(tok, arch), tok.pad_token_id, seed=0))
    params = SamplingParams(1.0, 1.0, 6, tpl.stop_ids(), seed=3)
    trajs = run_episodes(make_env, engine, tok, [1, 2], 2, params, chat=ChatMode(tpl))
    by_session = engine.per_session()
    sessions = engine.calls[0].sessions
    for i, t in enumerate(trajs):
        turns = by_session[sessions[i]]
        sampled = [x for _, c in turns for x in c.token_ids]
        assert [x for x, m in zip(t.token_ids, t.loss_mask, strict=True) if m] == sampled
        assert t.num_generated == len(sampled) and t.num_turns == len(turns) == 3
        pos = 0  # each prompt is the episode's ids so far; the completion follows it verbatim
        for prompt, comp in turns:
            assert t.token_ids[: len(prompt)] == prompt and len(prompt) >= pos
            span = slice(len(prompt), len(prompt) + len(comp.token_ids))
            assert t.token_ids[span] == comp.token_ids and all(t.loss_mask[span])
            assert t.rollout_logprobs[span] == comp.logprobs
            pos = span.stop
        assert t.token_ids[: len(turns[0][0])] == tpl.render_ids(make_env().reset(1 + i // 2), True)
    if kind == "chatml":  # ChatML is prefix-stable: no drift even for random text
        assert all(not t.info["template_drift"] for t in trajs)


# -- drift ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["chatml", "llama3"])
def test_prefix_stable_templates_have_no_drift(toks, kind):
    tok = toks[kind]
    box = _toolbox()
    tpl = ChatTemplate(tok, box.schemas if kind == "chatml" else None)
    replies = [CALL, "Let me check.", "The answer is 42."]
    make_env = lambda: ToolEnv(AddEnv(follow_ups=1), box)  # noqa: E731
    engine = ScriptedEngine(tok, replies, tpl.end_id)
    trajs = run_episodes(make_env, engine, tok, [4, 5], 2, SamplingParams(), chat=ChatMode(tpl))
    assert message_metrics(trajs)["rollout/template_drift"] == 0.0
    for i, t in enumerate(trajs):
        conv = _replay(make_env, [4, 5][i // 2], replies)
        assert conv[3]["role"] == "tool" and conv[3]["content"] == "42"
        # the trained text is exactly the template's rendering of the whole conversation
        assert tpl.decode(t.token_ids) == tpl.render(conv, False)
        if kind == "chatml":  # and so are the ids, where every turn starts at a clean boundary
            assert t.token_ids == tpl.render_ids(conv, False)
        # (Llama-3's generation prompt ends in "\n\n", which this byte-level BPE merges with
        # the reply's first characters when the whole text is tokenised at once: the same text
        # in other ids, which is why the drift check compares text.)
        assert not t.info["template_drift"] and t.info["tool_calls"] == 1
        sampled = [
            x for r in replies for x in [*tok.encode(r, add_special_tokens=False), tpl.end_id]
        ]
        assert [x for x, m in zip(t.token_ids, t.loss_mask, strict=True) if m] == sampled


def test_think_stripping_template_drift_is_detected_and_warned(toks, caplog):
    tok = toks["chatml_strip_think"]
    tpl = ChatTemplate(tok)
    replies = ["<think>add them</think>It is 42.", "<think>again</think>Yes, 42."]
    engine = ScriptedEngine(tok, replies, tpl.end_id)
    with caplog.at_level(logging.WARNING, logger="gyre.rollout.chat"):
        trajs = run_episodes(
            lambda: AddEnv(1), engine, tok, [7], 2, SamplingParams(), chat=ChatMode(tpl)
        )
    assert message_metrics(trajs)["rollout/template_drift"] == 1.0
    assert "strips <think>" in caplog.text and "rollout.stepwise" in caplog.text
    conv = _replay(lambda: AddEnv(1), 7, replies)
    assert trajs[0].token_ids != tpl.render_ids(conv, False)
    # the concatenation still holds every sampled id, with the template's user turn in between
    text = tpl.decode(trajs[0].token_ids)
    assert "<think>add them</think>It is 42.<|im_end|>\n<|im_start|>user\nAre you sure?" in text


def test_stepwise_samples_equal_what_the_model_saw(toks):
    tok = toks["chatml_strip_think"]
    tpl = ChatTemplate(tok)
    replies = ["<think>add them</think>It is 42.", "<think>hm</think>Still 42.", "42."]
    engine = ScriptedEngine(tok, replies, tpl.end_id)
    mode = ChatMode(tpl, stepwise=True)
    trajs = run_episodes(lambda: AddEnv(2), engine, tok, [3], 1, SamplingParams(), chat=mode)
    (t,) = trajs
    assert t.steps is not None and len(t.steps) == 3 == len(engine.prompts)
    conv = _replay(lambda: AddEnv(2), 3, replies)
    assistant_at = [k for k, m in enumerate(conv) if m["role"] == "assistant"]
    for k, (step, seen) in enumerate(zip(t.steps, engine.prompts, strict=True)):
        reply = [*tok.encode(replies[k], add_special_tokens=False), tpl.end_id]
        assert step.token_ids == seen + reply  # prompt = exactly what the engine was given
        assert step.loss_mask == [0] * len(seen) + [1] * len(reply)
        # ... which is the template's own rendering of the conversation at that turn
        assert seen == tpl.render_ids(conv[: assistant_at[k]], True)
    assert "<think>add them</think>" not in tpl.decode(engine.prompts[2])  # stripped, as served


def test_stepwise_rows_share_the_episode_advantage():
    from gyre.types import Trajectory

    def traj(reward, group, n_steps):
        steps = [Trajectory([1, 2, 3], [0, 1, 1], [0.0] * 3, 0.0, 0, -1, 1, False, 0)] * n_steps
        return Trajectory([1, 2], [0, 1], [0.0, 0.0], reward, group, 5, n_steps, False, 0,
                          steps=steps)  # fmt: skip

    eps = [traj(1.0, 0, 3), traj(0.0, 0, 1), traj(2.0, 1, 2), traj(0.0, 1, 2)]
    rows, episode = expand_steps(eps)
    assert episode.tolist() == [0, 0, 0, 1, 2, 2, 3, 3]
    assert [r.reward for r in rows] == [1.0, 1.0, 1.0, 0.0, 2.0, 2.0, 0.0, 0.0]
    assert {r.policy_version for r in rows} == {5} and [r.group_id for r in rows][:4] == [0] * 4
    rewards = torch.tensor([r.reward for r in rows])
    groups = torch.tensor([r.group_id for r in rows])
    adv = episode_advantages(grpo_advantages, rewards, None, groups, episode)
    # groups of two episodes each: (r - mean) / std = +-0.7071 whatever the turn counts
    s = 2**-0.5
    assert torch.allclose(adv, torch.tensor([s, s, s, -s, s, s, -s, -s]), atol=1e-5)
    # a per-episode penalty (KL) is the sum over its rows: episode 0 pays 3 x 0.5 -> tie
    pen = torch.tensor([0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0])
    adv = episode_advantages(grpo_advantages, rewards, pen, groups, episode)
    assert adv[0] < 0 < adv[3]  # 1 - 1.5 = -0.5 < 0


# -- limits ---------------------------------------------------------------------------------------
def test_context_and_turn_limits_truncate(toks):
    tok = toks["chatml"]
    tpl = ChatTemplate(tok)
    engine = ScriptedEngine(tok, ["Not sure."], tpl.end_id)
    first = len(tpl.render_ids(AddEnv(5).reset(0), True))
    mode = ChatMode(tpl, max_context_tokens=first + 12)
    (t,) = run_episodes(lambda: AddEnv(5), engine, tok, [0], 1, SamplingParams(), chat=mode)
    assert t.truncated and t.info["truncated_context"] and t.num_turns == 1
    assert len(t.token_ids) <= first + 12 + 1  # + the closing glue
    assert message_metrics([t])["rollout/truncated_context"] == 1.0
    mode = ChatMode(tpl, max_turns=2)
    (t,) = run_episodes(lambda: AddEnv(5), engine, tok, [0], 1, SamplingParams(), chat=mode)
    assert t.truncated and t.info["truncated_turns"] and t.num_turns == 2


# -- tool calls -----------------------------------------------------------------------------------
def test_hermes_parser_hand_cases():
    p = HermesParser()
    assert p.parse("no call here") == []
    assert p.parse(CALL) == [ToolCall("calculator", {"expression": "12 + 30"})]
    two = p.parse(
        'a <tool_call>{"name": "x", "arguments": {"a": 1}}</tool_call> b '
        '<tool_call>{"name": "y", "arguments": "{\\"b\\": 2}"}</tool_call>'
    )
    assert two == [ToolCall("x", {"a": 1}), ToolCall("y", {"b": 2})]
    (bad,) = p.parse('<tool_call>{"name": "x", "arguments": {</tool_call>')
    assert bad.error.startswith("tool call is not valid JSON")
    (shape,) = p.parse('<tool_call>["x"]</tool_call>')
    assert "must be" in shape.error
    (unclosed,) = p.parse('<tool_call>{"name": "x", "arguments": {}}')  # cut by max tokens
    assert unclosed == ToolCall("x", {})


def test_tool_env_answers_calls_and_counts_errors():
    env = ToolEnv(AddEnv(), _toolbox(), max_tool_calls=4)
    env.reset(0)
    reply = (
        CALL
        + '<tool_call>{"name": "calculator", "arguments": {"expression": "1 / 0"}}</tool_call>'
        + '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
        + "<tool_call>{oops</tool_call>"
    )
    msgs, r, done, info = env.step(reply)
    assert [m["role"] for m in msgs] == ["tool"] * 4 and r == 0.0 and not done
    assert msgs[0]["content"] == "42"
    assert msgs[1]["content"] == "error: calculator: division by zero"
    assert msgs[2]["content"].startswith("error: unknown tool 'search'")
    assert msgs[3]["content"].startswith("error: tool call is not valid JSON")
    assert info == {"tool_calls": 4, "tool_errors": 3}
    msgs, _, _, info = env.step('<tool_call>{"name": "calculator", "arguments": {"x": 1}}')
    assert msgs[0]["content"] == "error: tool call limit (4) reached"
    msgs, r, done, info = env.step(f"It is {env.env.a + env.env.b}.")  # the final answer
    assert done and r == 1.0 and info["success"] and info["tool_errors"] == 4


def test_tool_argument_checks():
    box = _toolbox()
    assert box.call(ToolCall("calculator", {}))[0] == (
        "error: calculator: missing argument(s) expression"
    )
    assert box.call(ToolCall("calculator", {"expression": 3}))[0] == (
        "error: calculator: argument expression must be a string"
    )
    assert box.call(ToolCall("calculator", {"expression": "1", "y": 2}))[1]


def test_calculator_is_arithmetic_only():
    assert safe_eval("2 * (3 + 4) - 10 / 4") == 11.5
    assert safe_eval("-2 ** 3 // 3 % 5") == 2
    for bad in ("__import__('os').system('true')", "x + 1", "2 ** 100000", "(1).real", "1e308*10"):
        with pytest.raises(ToolError):
            safe_eval(bad)


def _sandbox_network() -> str:
    from test_sandbox import NETWORK

    return NETWORK


def test_python_tool_runs_sandboxed_and_is_killed_at_its_time_limit():
    tool = python_tool(
        SandboxConfig(timeout_s=2.0, memory_mb=512, workers=1, network=_sandbox_network())
    )
    try:
        assert tool.fn(code="print(6 * 7)") == "42\n"
        assert tool.fn(code="1 / 0").endswith("ZeroDivisionError: division by zero")
        with pytest.raises(ToolError, match="python timeout: killed after the 2s"):
            tool.fn(code="while True:\n    pass")
        assert tool.fn(code="print('alive')") == "alive\n"  # a fresh worker took over
        box = Toolbox({"python": tool}, HermesParser())
        text, failed = box.call(ToolCall("python", {"code": "import time; time.sleep(30)"}))
        assert failed and text.startswith("error: python: python timeout")
    finally:
        tool.fn.close()
