"""``env.name=maze_chat``: the text maze spoken in chat messages, through a chat template."""

from __future__ import annotations

import json

import numpy as np

from chat_helpers import build_chat_model, build_chat_tokenizer
from gyre.config import load_config
from gyre.config.maze import MAZE_CHAT_SYSTEM
from gyre.envs import env_factory
from gyre.envs.maze import MazeEnv
from gyre.envs.maze_chat import MazeChatEnv
from gyre.runners import train


def test_the_chat_maze_is_the_text_maze_in_messages():
    cfg = load_config(None, ["env.name=maze_chat", "env.maze.size=6"]).env
    env = env_factory(cfg)()
    text = MazeEnv.from_config(cfg.maze)
    opening = env.reset(7)
    assert [m["role"] for m in opening] == ["system", "user"]
    assert opening[0]["content"] == MAZE_CHAT_SYSTEM
    assert opening[1]["content"] == text.reset(7)  # the same maze, the same first observation
    rng, twin = np.random.default_rng(0), np.random.default_rng(0)
    done = False
    while not done:
        move = env.expert_action(rng)
        assert move == text.expert_action(twin)
        msgs, reward, done, _ = env.step(f" {move}.")  # whitespace and a full stop ignored
        obs, r2, done2, _ = text.step(move)
        assert msgs == [{"role": "user", "content": obs}] and (reward, done) == (r2, done2)
    assert env.state_key() == text.state_key()
    text.reset(7)
    assert env.render_episode(7, [" x."])["maze"]["positions"] == [list(text.start)]
    cfg = load_config(None, ["env.name=maze_chat", "env.maze_chat.system=Walk the maze."]).env
    assert env_factory(cfg)().reset(7)[0] == {"role": "system", "content": "Walk the maze."}


def test_a_malformed_reply_is_a_wasted_move_and_no_system_message_when_empty():
    env = MazeChatEnv(MazeEnv(size=5), system="")
    assert [m["role"] for m in env.reset(3)] == ["user"]
    pos = env.maze.pos
    _, reward, _, _ = env.step("I think I will go up")
    assert env.maze.pos == pos and reward == 0.0 and env.maze.moves == 1


def test_sft_then_grpo_through_a_chat_template_memoryless(tmp_path):
    tok = build_chat_tokenizer("chatml")
    model = build_chat_model(tok, "qwen2", seed=0)
    model.save_pretrained(tmp_path / "init")
    tok.save_pretrained(tmp_path / "init")
    run_dir = tmp_path / "run"
    overrides = (
        "run.threads=1 log.console=off env.name=maze_chat rollout.history_turns=0 "
        "rollout.keep_opening=false sft.steps=2 sft.demos=16 sft.batch_size=4 train.steps=1 "
        "train.tasks_per_step=2 train.group_size=2 train.sampling.max_new_tokens=4 "
        "train.algo.advantage=gigpo eval.episodes=2 checkpoint.every=0"
    ).split()
    cfg = load_config(None, [f"model.path={tmp_path / 'init'}", f"run.dir={run_dir}", *overrides])
    train(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert len(steps) == 1 and steps[0]["rollout/template_drift"] == 0.0
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and "<|im_start|>system" in samples[0]["text_special"]
