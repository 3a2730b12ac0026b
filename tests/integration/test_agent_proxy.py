"""Agents gyre did not write: the official ``openai`` client drives a multi-turn agent with
tools through ``gyre serve --record``; the recording trains with ``gyre train
train.source=DIR``.

The fast test runs the real engine in process (FastAPI's TestClient) on a tiny random Qwen2
with a byte-level BPE + ChatML tokenizer: every call's prompt is the recorded prefix, the mask
is exactly the sampled ids, the recorded logprobs equal the trainer's recomputation (fp32,
1e-4), and one ``gyre train`` step on the recording changes the weights. The slow test runs
examples/agent-proxy as its README says (a warmed-up model that really calls the calculator, a
``gyre serve --record`` process, the example agent, ``gyre train``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from chat_helpers import build_chat_model, build_chat_tokenizer
from gyre.cli import main as gyre_main
from gyre.models.build import load_pretrained
from gyre.rollout.recorded import read_records, to_trajectory
from gyre.serve.recorder import Recorder
from gyre.serve.server import ModelHost, create_app
from gyre.trainer.batch import collate, token_logprobs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "agent-proxy"
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"agent_proxy_{name}", EXAMPLE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    sys.path.insert(0, str(EXAMPLE))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(EXAMPLE))
    return mod


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(next(path.glob("*.safetensors")))


def _train(model_dir: Path, rec_dir: Path, run_dir: Path, steps: int, group: int) -> int:
    return gyre_main([
        "train", f"model.path={model_dir}", f"train.source={rec_dir}", f"run.dir={run_dir}",
        f"train.group_size={group}", "train.tasks_per_step=1", f"train.steps={steps}",
        "train.mini_batches=1", "train.lr=1e-2", "run.threads=1", "log.console=plain",
        "checkpoint.every=0", "train.algo.old_logprobs=recompute",
        "train.sampling.temperature=1.0",  # the agent's requests sampled at the server's 1.0
    ])  # fmt: skip


def test_openai_agent_recorded_token_in_token_out_and_trained(tmp_path):
    tok = build_chat_tokenizer("chatml")
    model_dir = tmp_path / "policy"
    build_chat_model(tok, seed=3).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    host = ModelHost(model_dir, "tiny", torch.device("cpu"), seed=0)
    calls: list[tuple[list[int], list[int], list[float]]] = []
    generate = host.generate

    def spy(model, reqs, params):
        outs = generate(model, reqs, params)
        calls.extend(
            (r.prompt_ids, o.token_ids, o.logprobs) for r, o in zip(reqs, outs, strict=True)
        )
        return outs

    host.generate = spy
    rec = Recorder(tmp_path / "rec", host.tokenizer, lambda msgs, meta: float(meta["bonus"]))
    with TestClient(create_app(host, recorder=rec), raise_server_exceptions=False) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
        )
        for i in range(4):  # four attempts at one task: one GRPO group
            messages = [{"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": "What is 12 + 30?"}]  # fmt: skip
            for follow_up in ("Are you sure?", None):
                r = client.chat.completions.create(
                    model="tiny", messages=messages, tools=[CALC], max_tokens=6,
                    extra_headers={"X-Gyre-Session": f"ep{i}"},
                    extra_body={"gyre_group": "task-7", "gyre_metadata": {"bonus": i / 4}},
                )  # fmt: skip
                messages.append(r.choices[0].message.model_dump(exclude_none=True))
                if follow_up:
                    messages.append({"role": "user", "content": follow_up})
            if i < 2:
                client.post(f"/gyre/episodes/ep{i}/reward", body={"reward": i}, cast_to=object)
            else:  # the --reward-fn callback scores it
                client.post(f"/gyre/episodes/ep{i}/end", cast_to=object)
    records = read_records(tmp_path / "rec", len(tok), 1.0, 1.0)
    assert [r["reward"] for r in records] == [0.0, 1.0, 0.5, 0.75]
    model, _ = load_pretrained(model_dir, torch.device("cpu"))
    for k, record in enumerate(records):
        assert record["num_calls"] == 2 and len(record["segments"]) == 1
        seg = record["segments"][0]
        ids, mask = seg["token_ids"], seg["loss_mask"]
        spans = seg["turn_spans"]
        for (prompt, sampled, lps), (a, b) in zip(calls[2 * k : 2 * k + 2], spans, strict=True):
            assert ids[:a] == prompt  # token-in: the engine saw exactly the recorded prefix
            assert ids[a:b] == sampled and seg["rollout_logprobs"][a:b] == lps  # token-out
        assert mask == [int(any(a <= t < b for a, b in spans)) for t in range(len(ids))]
        traj = to_trajectory(record, 0, "0:0")
        with torch.no_grad():
            logp, _ = token_logprobs(model, collate([traj], tok.pad_token_id, torch.device("cpu")))
        m = torch.tensor(mask, dtype=torch.bool)
        gap = (logp[0][m] - torch.tensor(seg["rollout_logprobs"])[m]).abs().max()
        assert float(gap) < 1e-4, (k, float(gap))
    assert _train(model_dir, tmp_path / "rec", tmp_path / "run", 1, 4) == 0
    before, after = _weights(model_dir), _weights(tmp_path / "run" / "final")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    step1 = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[1])
    assert step1["step"] == 1 and step1["train/rollout_logprob_gap"] < 1e-4
    assert step1["rollout/reward_mean"] == pytest.approx(0.5625)


@pytest.mark.slow
def test_example_agent_proxy_end_to_end(tmp_path):
    """examples/agent-proxy/README.md's commands, in order (a smaller warm-up)."""
    from serve_helpers import start_server

    make_model, agent = _example("make_model"), _example("agent")
    model_dir, _ = make_model.make(tmp_path / "model", steps=150, tasks=16, seed=0)
    rec_dir = tmp_path / "rec"
    served = start_server(model_dir, tmp_path, extra_args=("--record", str(rec_dir)))
    try:
        assert (
            agent.main(["--base-url", f"{served.url}/v1", "--tasks", "4", "--attempts", "4"]) == 0
        )
        stats = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none").get(
            "/gyre/recording", cast_to=object
        )
    finally:
        served.stop()
    assert stats["episodes"] == 16 and stats["open_episodes"] == 0
    records = read_records(rec_dir, 10_000, 1.0, 1.0)
    assert sum(r["tool_calls"] for r in records) > 0  # the warmed-up policy calls the tool
    assert _train(model_dir, rec_dir, tmp_path / "run", 2, 4) == 0
    before, after = _weights(model_dir), _weights(tmp_path / "run" / "final")
    assert any(not torch.equal(before[k], after[k]) for k in before)
