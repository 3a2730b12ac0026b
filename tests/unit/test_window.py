"""rollout.history_turns: a bounded history in each turn's prompt (gyre.rollout.window)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chat_helpers import AddEnv, ScriptedEngine, build_chat_tokenizer
from gyre.algos import AdvantageInputs, AdvantageSettings, Turns, compute_advantages
from gyre.config import load_config, load_recipe
from gyre.engines.torch_engine import TorchEngine
from gyre.envs.maze import MazeEnv, Teacher
from gyre.rollout.chat import ChatMode, ChatTemplate
from gyre.rollout.demonstrate import demonstrate
from gyre.rollout.episodes import run_episodes
from gyre.rollout.window import Window, window_messages
from gyre.trainer.batch import collate, token_logprobs
from gyre.trainer.stepwise import expand_steps, turn_row_advantages
from gyre.types import SamplingParams, Trajectory
from helpers import RecordingEngine, bpe_chat_tokenizer, tiny_qwen2


def test_select_keeps_the_opening_and_the_last_exchanges():
    segs = ["o0", "a1", "o1", "a2", "o2"]
    assert Window(0, keep_opening=False).select(segs) == ["o2"]
    assert Window(0).select(segs) == ["o0", "o2"]
    assert Window(1).select(segs) == ["o0", "o1", "a2", "o2"]
    assert Window(1, keep_opening=False).select(segs) == ["o1", "a2", "o2"]
    assert Window(2).select(segs) == segs and Window(5, False).select(segs) == segs
    assert Window(0, False).select(["o0"]) == ["o0"]  # the first turn sees the opening
    with pytest.raises(ValueError, match="opening"):
        Window(0).select(["o0", "a1"])
    with pytest.raises(ValueError, match="history_turns"):
        Window(-1)


def test_window_messages_keep_system_messages_and_whole_answers():
    sys_ = {"role": "system", "content": "be brief"}
    u0 = {"role": "user", "content": "task"}
    a1 = {"role": "assistant", "content": "call"}
    t1, u1 = {"role": "tool", "content": "42"}, {"role": "user", "content": "and?"}
    a2, u2 = {"role": "assistant", "content": "42"}, {"role": "user", "content": "sure?"}
    conv = [sys_, u0, a1, t1, u1, a2, u2]
    assert window_messages(Window(0, False), conv) == [sys_, u2]
    assert window_messages(Window(0), conv) == [sys_, u0, u2]
    assert window_messages(Window(1, False), conv) == [sys_, t1, u1, a2, u2]  # one answer, whole
    assert window_messages(Window(3), conv) == conv


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE tokenizer whose newline is no single token (stop strings end a turn)."""
    return bpe_chat_tokenizer(newline=False)


def _maze_run(tok, window, stop_strings=("\n",), seeds=(3, 4), group=2):
    model = tiny_qwen2(tok, seed=1)
    engine = RecordingEngine(TorchEngine(model, tok.pad_token_id, seed=0))
    params = SamplingParams(0.7, 0.9, 4, (), seed=5, stop_strings=tuple(stop_strings))
    make_env = lambda: MazeEnv(observation="exits", view=2)  # noqa: E731
    trajs = run_episodes(make_env, engine, tok, list(seeds), group, params, window=window)
    return model, engine, trajs


@pytest.mark.parametrize(("turns", "keep"), [(0, False), (1, True)])
def test_raw_windowed_prompts_are_what_the_engine_saw(bpe, turns, keep):
    """Raw-text maze, BPE tokenizer: each turn's sample = the engine's prompt + its sampled
    ids (mask 1 only there), and the prompt is the window of the episode's own ids."""
    window = Window(turns, keep)
    assert bpe.bos_token_id is None  # the opening segment is the first observation's ids
    _, engine, trajs = _maze_run(bpe, window)
    prompts = engine.per_session()
    for t, session in zip(trajs, prompts, strict=True):
        assert t.steps is not None and len(t.steps) == t.num_turns == len(t.turn_spans)
        # the episode's segments, cut out of its full transcript by the turn spans
        spans = t.turn_spans
        segs = [t.token_ids[: spans[0][0]]]
        for k, (s, e) in enumerate(spans):
            segs.append(t.token_ids[s:e])
            nxt = spans[k + 1][0] if k + 1 < len(spans) else len(t.token_ids)
            segs.append(t.token_ids[e:nxt])
        for k, (step, (seen, out)) in enumerate(zip(t.steps, prompts[session], strict=True)):
            assert seen == [x for seg in window.select(segs[: 2 * k + 1]) for x in seg]
            sampled = t.token_ids[spans[k][0] : spans[k][1]]
            assert step.token_ids == seen + sampled
            assert step.loss_mask == [0] * len(seen) + [1] * len(sampled)
            assert step.rollout_logprobs[len(seen) :] == list(out.logprobs[: len(sampled)])
        if not keep and t.num_turns > 1:  # memoryless: the map of the opening is gone
            assert len(t.steps[1].token_ids) < len(t.steps[0].token_ids)


def test_windowed_rows_score_as_the_engine_sampled(bpe):
    """Engine and trainer log-probs agree on the windowed rows (fp32, T 0.7 / top-p 0.9)."""
    model, _, trajs = _maze_run(bpe, Window(1, keep_opening=False))
    rows, episodes = expand_steps(trajs)
    assert episodes is not None and len(rows) == sum(t.num_turns for t in trajs)
    batch = collate(rows, bpe.pad_token_id, torch.device("cpu"))
    logp, _ = token_logprobs(model, batch, 0.7, 0.9)
    m = batch.loss_mask.bool()
    assert m.sum() == sum(sum(r.loss_mask) for r in rows)
    assert torch.allclose(logp[m], batch.rollout_logprobs[m], atol=1e-4)


def test_chat_window_renders_the_windowed_conversation():
    """ChatML on a BPE tokenizer: the prompt of turn k is the template's rendering of the
    window of the conversation, never the whole of it."""
    tok = build_chat_tokenizer("chatml")
    tpl = ChatTemplate(tok)
    replies = ["It is 42.", "Still 42.", "42."]
    engine = ScriptedEngine(tok, replies, tpl.end_id)
    mode = ChatMode(tpl, window=Window(0, keep_opening=False))
    (t,) = run_episodes(lambda: AddEnv(2), engine, tok, [3], 1, SamplingParams(), chat=mode)
    assert t.steps is not None and len(t.steps) == 3 == len(engine.prompts)
    env = AddEnv(2)
    conv = list(env.reset(3))
    for k, reply in enumerate(replies):
        seen = engine.prompts[k]
        want = tpl.render_ids(window_messages(Window(0, False), conv), True)
        assert seen == want and t.steps[k].token_ids[: len(seen)] == seen
        conv.append({"role": "assistant", "content": reply})
        new, _, _, _ = env.step(reply)
        conv.extend(new)
    # the full transcript is still recorded (the report's view of the episode)
    assert tpl.decode(t.token_ids).count("<|im_start|>assistant") == 3


def test_demonstrations_carry_the_windowed_turns(bpe):
    """SFT samples under a window: one per turn, prompt = the window, mask = the teacher's move
    (0 on a random one)."""
    env = lambda: MazeEnv(observation="exits", view=2, teacher=Teacher("greedy"))  # noqa: E731
    rng = np.random.default_rng(0)
    nl = bpe.encode("\n", add_special_tokens=False)
    d = demonstrate(env, bpe, 11, 0.5, rng, terminator=nl, window=Window(0, False))
    assert d.steps is not None and len(d.steps) == d.num_turns
    full = bpe.decode(d.token_ids)
    for step in d.steps:
        n = len(step.token_ids) - len(nl) - 1  # prompt + one move letter + the newline ids
        assert sum(step.loss_mask) in (0, 1 + len(nl)) and step.loss_mask[:n] == [0] * n
        assert bpe.decode(step.token_ids[:n]) in full  # the window is text of the episode
    assert sum(sum(s.loss_mask) for s in d.steps) == sum(d.loss_mask)  # same trained moves


def _ep(states, rewards, group, reward):
    spans = [(k + 1, k + 2) for k in range(len(states))]  # position 0: the prompt
    steps = [Trajectory([1, 2], [0, 1], [0.0, 0.0], 0.0, 0, -1, 1, False, 0)] * len(states)
    return Trajectory([0] * (len(states) + 1), [0] + [1] * len(states), [0.0] * (len(states) + 1),
                      reward, group, 0, len(states), reward > 0, 0, turn_spans=spans,
                      turn_states=states, turn_rewards=rewards, steps=steps)  # fmt: skip


def test_turn_credit_on_rows_equals_it_on_whole_episodes():
    """GiGPO on step-wise rows gives row k of an episode exactly turn k's advantage of the
    whole-episode computation (two episodes through a shared state, one bumping a wall)."""
    eps = [
        _ep(["s0", "s1", "s1", "s2"], [0, 0, 0, 1], 0, 1.0),  # bumps in s1, then succeeds
        _ep(["s0", "s1", "s2"], [0, 0, 1], 0, 1.0),
        _ep(["s0", "s3"], [0, 0], 0, 0.0),
    ]
    turns = Turns.of(eps)
    mask = torch.tensor([(t.loss_mask + [0] * 5)[:5] for t in eps], dtype=torch.float)
    rewards = torch.tensor([t.reward for t in eps])
    groups = torch.tensor([0, 0, 0])
    settings = AdvantageSettings(eps=1e-6, gamma=0.9)
    inputs = AdvantageInputs(loss_mask=mask, turns=turns)
    whole, _ = compute_advantages("gigpo", rewards, groups, inputs, settings)
    rows, episodes = expand_steps(eps)
    row_rewards = torch.tensor([r.reward for r in rows])
    row_groups = torch.tensor([r.group_id for r in rows])
    adv = turn_row_advantages("gigpo", row_rewards, row_groups, episodes, turns, settings)
    want = [float(whole[e, k + 1]) for e, t in enumerate(eps) for k in range(t.num_turns)]
    assert torch.allclose(adv, torch.tensor(want), atol=1e-6)
    # the bump (s1 -> s1) of episode 0 gets less than the move out of s1 of episode 1
    assert adv[1] < adv[5]


def test_config_takes_turn_estimators_and_refuses_token_ones():
    cfg = load_config(None, ["rollout.history_turns=0", "train.algo.advantage=gigpo"])
    assert cfg.rollout.history_turns == 0 and cfg.rollout.keep_opening  # nothing else changes
    cfg = load_config(None, ["env.name=arithmetic", "rollout.history_turns=0"])
    assert cfg.rollout.history_turns == 0 and cfg.rollout.keep_opening
    with pytest.raises(ValueError, match=r"rollout\.history_turns needs an outcome or turn"):
        load_config(None, ["rollout.history_turns=1", "train.algo.advantage=gae"])
    with pytest.raises(ValueError, match="kl_in must be 'loss'"):
        load_config(None, ["rollout.history_turns=1", "train.algo.kl_in=reward"])
    with pytest.raises(ValueError, match="history_turns"):
        load_config(None, ["rollout.history_turns=-1"])


def test_the_maze_recipe_is_memoryless_with_level_replay_and_changes_nothing_unasked():
    """The maze recipe's file sets the memoryless window and level replay; what it does not fit
    (a per-token estimator, the Ray runner) is an error naming the key, never a silent change."""
    cfg = load_recipe()
    assert (cfg.rollout.history_turns, cfg.rollout.keep_opening) == (0, False)
    assert cfg.train.level_replay.prob == 0.5
    whole = load_recipe("maze", ["rollout.history_turns=all", "rollout.keep_opening=true",
                                 "train.level_replay.prob=0"])  # fmt: skip
    assert (whole.rollout.history_turns, whole.rollout.keep_opening) == (None, True)
    assert whole.train.level_replay.prob == 0.0
    other = load_config(None, ["env.name=arithmetic"])
    assert other.rollout.history_turns is None and other.rollout.keep_opening
    assert other.train.level_replay.prob == 0.0
    with pytest.raises(ValueError, match=r"train\.level_replay\.prob > 0"):
        load_recipe("maze", ["runner=ray"])
    ray = load_recipe("maze", ["runner=ray", "train.level_replay.prob=0"])
    assert ray.rollout.history_turns == 0
    with pytest.raises(ValueError, match=r"rollout\.history_turns needs an outcome"):
        load_recipe("maze", ["train.algo.advantage=gae"])


def test_a_saved_maze_config_reloads_to_the_same_window(tmp_path):
    from gyre.config import dump_config

    for over in ([], ["rollout.history_turns=all", "train.level_replay.prob=0"]):
        cfg = load_recipe("maze", over)
        path = tmp_path / "config.yaml"
        path.write_text(dump_config(cfg))
        again = load_config(path)
        assert again.rollout == cfg.rollout and again.train == cfg.train
