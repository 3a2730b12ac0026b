"""A tiny Qwen2 with a byte-level BPE + ChatML tokenizer (tests/helpers.py), SFT'd on arithmetic
through ``gyre sft``: its turns end at the stop token SFT taught, and it solves held-out tasks.

Before stop tokens were derived from the tokenizer, ``convert_tokens_to_ids("\\n")`` was None for
such a tokenizer, only EOS ended a turn, and the SFT'd model wrote ``"2\\n2+"`` (0 % success).
"""

from __future__ import annotations

import json

import pytest
import torch

from gyre.cli import main
from gyre.engines import TorchEngine
from gyre.envs.arithmetic import ArithmeticEnv
from gyre.models.build import load_pretrained
from gyre.rollout.episodes import run_episodes
from gyre.rollout.evaluate import eval_seeds
from gyre.rollout.stops import derive_stops
from gyre.types import SamplingParams
from helpers import RecordingEngine, save_qwen2_bpe

ENV = ["env.name=arithmetic", "env.arithmetic.max_operand=2", "env.arithmetic.ops=+"]
QUIET = ["log.console=off", "run.threads=1"]


def _sft(tmp_path, newline: bool):
    base = save_qwen2_bpe(tmp_path / "base", seed=0, newline=newline)
    run = tmp_path / "run"
    args = [
        "sft",
        f"model.path={base}",
        f"run.dir={run}",
        *ENV,
        *QUIET,
        "sft.steps=200",
        "sft.batch_size=16",
        "sft.demos=200",
        "sft.noise=0",
        "sft.lr=0.003",
        "sft.lr_schedule=constant",
    ]  # constant 3e-3: the fast, steady SFT this test was calibrated on
    assert main(args) == 0
    return run / "sft"


@pytest.mark.parametrize("newline", [True, False], ids=["newline-token", "no-newline-token"])
def test_sft_then_eval_ends_turns_at_the_stop_token(tmp_path, newline):
    sft = _sft(tmp_path, newline)
    model, tok = load_pretrained(sft, torch.device("cpu"))
    stops = derive_stops(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    if newline:
        assert stops.terminator == tuple(tok.encode("\n", add_special_tokens=False))
    else:
        assert stops.terminator == (im_end,)
    engine = RecordingEngine(TorchEngine(model, tok.pad_token_id, seed=0))
    params = SamplingParams(1.0, 1.0, 4, stops.token_ids, seed=3, stop_strings=stops.strings)
    trajs = run_episodes(
        lambda: ArithmeticEnv(2, "+"), engine, tok, eval_seeds(24), 1, params, continuous=False
    )
    completions = [c for call in engine.calls for c in call.completions]
    assert completions and all(c.finish_reason == "stop" for c in completions)
    assert all(c.token_ids[-1] == stops.terminator[0] for c in completions)
    assert not any(t.truncated for t in trajs)
    # held-out success through `gyre eval` on the same tokenizer
    out = tmp_path / "eval"
    assert main(["eval", f"model.path={sft}", f"run.dir={out}", *ENV, *QUIET,
                 "eval.episodes=30"]) == 0  # fmt: skip
    res = json.loads((out / "eval.json").read_text())
    assert res["eval/success_greedy"] > 0.5
