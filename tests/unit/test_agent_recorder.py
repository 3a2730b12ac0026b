"""``gyre serve --record``: how a session's calls become one token sequence, driven by the
official ``openai`` client through FastAPI's TestClient, with a byte-level BPE + Qwen-style
ChatML tokenizer (tests/chat_helpers.py) and an engine that 'samples' scripted replies (so the
splice, the drift count and the rewrite rule are checked on known texts).
"""

from __future__ import annotations

import json

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from chat_helpers import build_chat_model, build_chat_tokenizer
from gyre.rollout.recorded import read_records, to_trajectory
from gyre.serve.recorder import Recorder
from gyre.serve.server import ModelHost, create_app
from gyre.types import Completion

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
START = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 12 + 30?"},
]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 30"}}\n</tool_call>'
COMPACT = '<tool_call>\n{"name":"calculator","arguments":{"expression":"12 + 30"}}\n</tool_call>'


class Scripted:
    """The host's engine: call k 'samples' ``replies[k]`` + the end-of-turn token."""

    def __init__(self, tok, replies: list[str]) -> None:
        self.tok, self.replies, self.version, self.model = tok, list(replies), 0, None
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []

    def reset_cache(self) -> None:
        pass

    def generate(self, reqs, params):
        outs = []
        for r in reqs:
            self.prompts.append(list(r.prompt_ids))
            ids = self.tok.encode(self.replies.pop(0), add_special_tokens=False)
            ids.append(self.tok.convert_tokens_to_ids("<|im_end|>"))
            assert ids[-1] in params.stop_token_ids  # the template's end of turn stops a reply
            self.sampled.append(ids)
            outs.append(Completion(ids, [-0.25] * len(ids), "stop"))
        return outs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = build_chat_tokenizer("chatml")
    path = tmp_path_factory.mktemp("chatml") / "model"
    build_chat_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _serve(model_dir, tmp_path, replies, reward_fn=None, idle_timeout_s=3600.0):
    host = ModelHost(model_dir, "tiny", torch.device("cpu"))
    host.engine = Scripted(host.tokenizer, replies)
    rec = Recorder(tmp_path / "rec", host.tokenizer, reward_fn, idle_timeout_s)
    http = TestClient(create_app(host, recorder=rec), raise_server_exceptions=False)
    client = openai.OpenAI(
        base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
    )
    return host, rec, http, client


def _ask(client, messages, session="s1", **kw):
    return client.chat.completions.create(
        model="tiny", messages=messages, tools=[CALC], max_tokens=64,
        extra_headers={"X-Gyre-Session": session, "X-Gyre-Group": "task-1"}, **kw,
    )  # fmt: skip


def _parsed(msgs):
    """The messages as the server renders them: tool-call arguments as objects (as vLLM)."""
    out = []
    for m in msgs:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def _records(rec, tok):
    return read_records(rec.dir, len(tok), 1.0, 1.0)


@pytest.mark.parametrize("compact", [False, True])
def test_tool_call_turn_is_spliced_on_the_sampled_ids(model_dir, tmp_path, compact):
    host, rec, http, client = _serve(
        model_dir, tmp_path, [COMPACT if compact else CALL, "The answer is 42."]
    )
    tok, eng = host.tokenizer, host.engine
    with http:
        r = _ask(client, START)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and not msg.content
        call = msg.tool_calls[0]
        assert call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": "12 + 30"}
        msgs = [*START, msg.model_dump(exclude_none=True)]
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
        r2 = _ask(client, msgs)
        assert r2.choices[0].message.content == "The answer is 42."
        msgs.append(r2.choices[0].message.model_dump(exclude_none=True))
        out = http.post("/v1/gyre/episodes/s1/reward", json={"reward": 1.0}).json()
    assert out["calls"] == 2 and out["rerender_drift_calls"] == int(compact)
    p0, p1 = eng.prompts
    s0, s1 = eng.sampled
    want0 = tok.apply_chat_template(START, tools=[CALC], add_generation_prompt=True)
    assert p0 == list(want0["input_ids"] if hasattr(want0, "keys") else want0)
    # the second prompt is the first + the ids sampled, unchanged + the tool turn's rendering
    assert p1[: len(p0) + len(s0)] == p0 + s0
    glue = tok.decode(p1[len(p0) + len(s0) :])
    assert glue == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" \
        "<|im_start|>assistant\n"  # fmt: skip
    (record,) = _records(rec, tok)
    seg = record["segments"][0]
    assert seg["token_ids"] == p1 + s1 + tok.encode("\n", add_special_tokens=False)
    spans = [(len(p0), len(p0) + len(s0)), (len(p1), len(p1) + len(s1))]
    assert [tuple(s) for s in seg["turn_spans"]] == spans
    assert seg["loss_mask"] == [int(any(a <= t < b for a, b in spans)) for t in
                                range(len(seg["token_ids"]))]  # fmt: skip
    sampled_lps = [x for x, m in zip(seg["rollout_logprobs"], seg["loss_mask"], strict=True) if m]
    assert sampled_lps == [-0.25] * (len(s0) + len(s1))
    text = tok.decode(seg["token_ids"])
    rendered = tok.apply_chat_template(_parsed(msgs), tools=[CALC], tokenize=False)
    # prefix-stable template and the model's own serialisation: the trained text is exactly
    # the template's rendering; a re-serialised call (compact JSON) is counted, and the
    # trajectory keeps what was sampled.
    assert (text == rendered) is (not compact)
    assert (COMPACT in text) is compact
    assert record["tool_calls"] == 1 and record["reward"] == 1.0 and record["group"] == "task-1"


def test_rewritten_history_starts_a_new_segment(model_dir, tmp_path):
    host, rec, http, client = _serve(model_dir, tmp_path, ["hello", "42"])
    with http:
        _ask(client, START)
        edited = [*START, {"role": "assistant", "content": "something else"},
                  {"role": "user", "content": "again"}]  # fmt: skip
        _ask(client, edited)
        out = http.post("/v1/gyre/episodes/s1/reward", json={"reward": 0.5}).json()
    assert out["rewrites"] == 1 and out["segments"] == 2
    eng = host.engine
    (record,) = _records(rec, host.tokenizer)
    a, b = record["segments"]
    assert a["token_ids"][: len(eng.prompts[0])] == eng.prompts[0]
    assert b["token_ids"][: len(eng.prompts[1])] == eng.prompts[1]
    assert "something else" in host.tokenizer.decode(eng.prompts[1])  # the agent's history
    traj = to_trajectory(record, 3, "3:0")
    assert [sum(s.loss_mask) for s in traj.steps] == [len(x) for x in eng.sampled]


def test_reward_fn_gets_the_conversation_and_metadata(model_dir, tmp_path):
    seen = []

    def reward(messages, metadata):
        seen.append((messages, metadata))
        if metadata.get("boom"):
            raise RuntimeError("scorer down")
        return 0.25, True

    host, rec, http, client = _serve(model_dir, tmp_path, ["hi", "yo"], reward)
    with http:
        _ask(client, START, extra_body={"gyre_metadata": {"answer": "42"}})
        _ask(client, START, session="s2", extra_body={"gyre_metadata": {"boom": True}})
        ok = http.post("/v1/gyre/episodes/s1/end")
        assert ok.status_code == 200 and ok.json()["reward"] == 0.25, ok.text
        bad = http.post("/v1/gyre/episodes/s2/end")
        assert bad.status_code == 500 and "scorer down" in bad.json()["error"]["message"]
        assert http.get("/v1/gyre/episodes/s2").json()["calls"] == 1  # still open
        assert http.post("/v1/gyre/episodes/s2/reward", json={"reward": 0}).status_code == 200
    messages, metadata = seen[0]
    assert metadata == {"answer": "42"}
    assert messages[-1] == {"role": "assistant", "content": "hi"}
    assert [r["success"] for r in _records(rec, host.tokenizer)] == [True, False]


def test_bad_calls_are_4xx_naming_the_field(model_dir, tmp_path):
    _, _, http, _ = _serve(model_dir, tmp_path, ["a", "b"])
    body = {"messages": START, "max_tokens": 4}
    with http:
        r = http.post("/v1/chat/completions", json={**body, "n": 2, "gyre_session": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        r = http.post(
            "/v1/chat/completions", json={**body, "gyre_session": "x"},
            headers={"X-Gyre-Session": "y"},
        )  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "gyre_session"
        r = http.post("/v1/gyre/episodes/nope/reward", json={"reward": 1})
        assert r.status_code == 404
        r = http.post("/v1/chat/completions", json={**body, "gyre_session": "x", "top_k": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
        r = http.post("/v1/chat/completions", json={**body, "gyre_session": "x"})
        assert r.status_code == 200
        r = http.post("/v1/gyre/episodes/x/end")
        assert r.status_code == 400 and "--reward-fn" in r.json()["error"]["message"]
        r = http.post("/v1/gyre/episodes/x/reward", json={"reward": "high"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reward"
        assert http.post("/v1/chat/completions", json=body).status_code == 200  # unrecorded
        stats = http.get("/v1/gyre/recording").json()
    assert stats["unrecorded_calls"] == 1 and stats["calls"] == 1 and stats["open_episodes"] == 1


def test_assistant_message_parses_hermes_tool_calls_only_with_tools():
    from gyre.serve.requests import assistant_message

    msg, bad = assistant_message("Let me check.\n" + CALL, tools=True)
    assert bad == 0 and msg["content"] == "Let me check."
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "12 + 30"}
    assert assistant_message(CALL, tools=False) == ({"role": "assistant", "content": CALL}, 0)
    broken = '<tool_call>\n{"name": "calculator", "arguments": {</tool_call>'
    assert assistant_message(broken, tools=True) == ({"role": "assistant", "content": broken}, 1)
    two, _ = assistant_message(CALL + "\n" + CALL, tools=True)
    assert two["content"] is None and len(two["tool_calls"]) == 2


def test_open_episodes_at_shutdown_are_scored_by_the_reward_fn(model_dir, tmp_path, capsys):
    host, rec, http, client = _serve(model_dir, tmp_path, ["hi"], lambda m, meta: 1.0)
    with http:
        _ask(client, START, session="left-open")
    (record,) = _records(rec, host.tokenizer)  # the server's shutdown ended it
    assert record["session"] == "left-open" and record["reward"] == 1.0
    _, rec2, http2, client2 = _serve(model_dir, tmp_path / "b", ["hi"])
    with http2:
        _ask(client2, START)
    assert not rec2.path.exists() and "never got a reward" in capsys.readouterr().err


def test_serve_cli_refuses_a_bad_reward_fn(model_dir, tmp_path, capsys):
    from gyre.serve import server

    missing = f"{tmp_path / 'nope.py'}:score"
    assert (
        server.main([str(model_dir), "--record", str(tmp_path / "r"), "--reward-fn", missing]) == 1
    )
    assert "--reward-fn" in capsys.readouterr().err
    assert server.main([str(model_dir), "--reward-fn", missing]) == 1
    assert "--reward-fn needs --record DIR" in capsys.readouterr().err


def test_an_abandoned_episode_is_dropped_and_counted(model_dir, tmp_path, capsys):
    """An agent that crashed mid-episode: DELETE drops its open episode (nothing recorded), the
    recording stats count it, and the session id is free again."""
    _, rec, http, client = _serve(model_dir, tmp_path, ["Thinking.", "The answer is 42."])
    with http:
        _ask(client, START, session="crashed")
        assert http.get("/v1/gyre/recording").json()["open_episodes"] == 1
        out = http.delete("/v1/gyre/episodes/crashed")
        assert out.status_code == 200 and out.json()["abandoned"] and out.json()["calls"] == 1
        assert http.delete("/v1/gyre/episodes/crashed").status_code == 404
        assert http.get("/v1/gyre/episodes/crashed").status_code == 404
        stats = http.get("/v1/gyre/recording").json()
        _ask(client, START, session="crashed")  # a fresh episode under the same id
        assert rec.sessions["crashed"].calls == 1
    assert stats["open_episodes"] == 0 and stats["abandoned_episodes"] == 1
    assert not rec.path.exists()  # nothing was recorded
    assert "episode 'crashed' abandoned by the agent: dropped" in capsys.readouterr().err


@pytest.mark.parametrize("with_reward_fn", [False, True])
def test_idle_episodes_end_after_the_session_timeout(model_dir, tmp_path, capsys, with_reward_fn):
    """--session-timeout: an episode idle for longer ends at the next call: recorded with
    --reward-fn's score where there is one, else dropped; a younger one stays open."""
    fn = (lambda messages, metadata: 0.5) if with_reward_fn else None
    host, rec, http, client = _serve(model_dir, tmp_path, ["a", "b", "c"], fn, idle_timeout_s=60)
    with http:
        _ask(client, START, session="old")
        _ask(client, START, session="young")
        rec.sessions["old"].active -= 61  # idle for 61 s
        assert rec.expire() == ["old"]
        assert set(rec.sessions) == {"young"}
        rec.sessions["young"].active -= 61
        _ask(client, START, session="new")  # each call first ends the idle episodes
        assert set(rec.sessions) == {"new"}
    err = capsys.readouterr().err
    if with_reward_fn:
        records = _records(rec, host.tokenizer)
        assert [r["session"] for r in records] == ["old", "young", "new"]  # new: at shutdown
        assert all(r["reward"] == 0.5 for r in records) and rec.stats["abandoned_episodes"] == 0
        assert "episode 'old' idle for over 60 s: ended, scored by --reward-fn" in err
    else:
        assert not rec.path.exists() and rec.stats["abandoned_episodes"] == 2
        assert "episode 'old' idle for over 60 s: dropped, not recorded" in err


def test_session_timeout_zero_keeps_idle_episodes_and_a_negative_one_is_refused(
    model_dir, tmp_path
):
    host, rec, http, client = _serve(model_dir, tmp_path, ["a"], idle_timeout_s=0)
    with http:
        _ask(client, START, session="s")
    rec.sessions["s"].active -= 10**9
    assert rec.expire() == [] and "s" in rec.sessions
    with pytest.raises(ValueError, match="--session-timeout must be >= 0 seconds, got -1"):
        Recorder(tmp_path / "r2", host.tokenizer, None, -1)
