"""Where a turn ends: stop tokens / strings derived from the tokenizer, the rollout's stop-string
cut (token-in/token-out) and the SFT terminator, with gyre's char tokenizer and a byte-level BPE
tokenizer with a ChatML template (built in tests/helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from gyre.config import load_config
from gyre.engines.base import EngineFeatures
from gyre.envs.arithmetic import ArithmeticEnv
from gyre.rollout.core import run_stops, sampling_params
from gyre.rollout.demonstrate import demonstrate
from gyre.rollout.episodes import run_episodes, stop_ids
from gyre.rollout.stops import cut_at_stop, derive_stops, newline_id
from gyre.types import Completion, SamplingParams
from helpers import bpe_chat_tokenizer


class ScriptedEngine:
    """Answers every request with the next completion of ``script`` (finish "length")."""

    version = 0
    features = EngineFeatures()

    def __init__(self, script: list[list[int]]) -> None:
        self.script = list(script)

    def generate(self, requests, params):
        outs = []
        for _ in requests:
            ids = self.script.pop(0)
            outs.append(Completion(ids, [-0.5 - k for k in range(len(ids))], "length"))
        return outs

    def release(self, sessions) -> None:
        list(sessions)


@pytest.fixture(scope="module")
def bpe():
    return bpe_chat_tokenizer()


def test_char_tokenizer_stops_are_unchanged(tokenizer):
    # before stop tokens were derived: {convert_tokens_to_ids("\n"), EOS} - {unk}
    legacy = tuple(sorted({tokenizer.convert_tokens_to_ids("\n"), tokenizer.eos_token_id}))
    stops = derive_stops(tokenizer)
    assert stops.token_ids == legacy == stop_ids(tokenizer)
    assert stops.terminator == (tokenizer.convert_tokens_to_ids("\n"),)
    assert stops.strings == ("\n",)


def test_bpe_stops_are_end_of_turn_eos_and_newline(bpe):
    nl = bpe.encode("\n", add_special_tokens=False)
    assert bpe.convert_tokens_to_ids("\n") is None  # the bug: "\n" is no vocabulary entry
    assert len(nl) == 1 and newline_id(bpe) == nl[0]
    stops = derive_stops(bpe)
    im_end = bpe.convert_tokens_to_ids("<|im_end|>")
    assert set(stops.token_ids) == {im_end, bpe.eos_token_id, nl[0]}
    assert stops.strings == ("\n",)
    assert stops.terminator == (nl[0],)


def test_bpe_without_newline_token_ends_turns_at_im_end(bpe):
    tok = bpe_chat_tokenizer(newline=False)
    assert newline_id(tok) is None
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    stops = derive_stops(tok)
    assert stops.token_ids == tuple(sorted({im_end, tok.eos_token_id}))
    assert stops.strings == ()
    assert stops.terminator == (im_end,)
    # SFT's answers end with the token the rollout stops at, and it is trained on
    demo = demonstrate(lambda: ArithmeticEnv(2, "+"), tok, 3, 0.0, np.random.default_rng(0))
    assert demo.token_ids[-1] == im_end and demo.loss_mask[-1] == 1
    answer = [t for t, m in zip(demo.token_ids, demo.loss_mask, strict=True) if m]
    env = ArithmeticEnv(2, "+")
    env.reset(3)
    assert tok.decode(answer[:-1]) == str(env.answer)


def test_stop_config_overrides_and_names_the_key(bpe):
    cfg = load_config(
        overrides=['rollout.stop_tokens=["<|im_end|>"]', "rollout.stop_strings=[';']"]
    )
    stops = run_stops(cfg, bpe)
    im_end = bpe.convert_tokens_to_ids("<|im_end|>")
    assert stops.token_ids == (im_end,) and stops.strings == (";",)
    assert stops.terminator == (im_end,)
    params = sampling_params(cfg, bpe, seed=1)
    assert params.stop_token_ids == (im_end,) and params.stop_strings == (";",)
    with pytest.raises(ValueError, match=r"rollout\.stop_tokens: 'quick brown'"):
        derive_stops(bpe, ["quick brown"])


def test_cut_at_stop_finds_the_token_completing_the_string(bpe):
    two_nl = bpe.encode("\n\n", add_special_tokens=False)
    assert len(two_nl) == 1  # a merged token holds both newlines
    ids = _sampled(bpe)

    def decode(key):
        return bpe.decode(list(key))

    k = cut_at_stop(ids, ["\n"], decode)
    assert ids[:k] == bpe.encode("3", add_special_tokens=False) + two_nl
    assert cut_at_stop(ids, ["zz"], decode) is None
    assert cut_at_stop(ids, [], decode) is None


def test_rollout_cuts_at_stop_string_and_keeps_sampled_ids(bpe):
    """A sampled "3ĊĊga" (no single-newline token, so no stop token fired): the turn is the
    sampled ids up to the merged newline token, with their own logprobs, finished by "stop"."""
    sampled = _sampled(bpe)
    engine = ScriptedEngine([sampled])
    stops = derive_stops(bpe)
    params = SamplingParams(1.0, 1.0, len(sampled), stops.token_ids, stop_strings=stops.strings)
    env_seed = next(s for s in range(100) if _answer(s) == 3)
    (traj,) = run_episodes(lambda: ArithmeticEnv(2, "+"), engine, bpe, [env_seed], 1, params)
    kept = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
    assert kept == sampled[:2]  # "3" and the merged newline token
    assert bpe.decode(kept).endswith("\n\n") and traj.success and not traj.truncated
    lps = [lp for lp, m in zip(traj.rollout_logprobs, traj.loss_mask, strict=True) if m]
    assert lps == [-0.5 - k for k in range(len(kept))]


def _answer(seed: int) -> int:
    env = ArithmeticEnv(2, "+")
    env.reset(seed)
    return env.answer


def _sampled(bpe) -> list[int]:
    """What a policy may sample: "3", the merged "\\n\\n" token, then "ga" (2 tokens)."""
    return [i for t in ("3", "\n\n", "ga") for i in bpe.encode(t, add_special_tokens=False)]
