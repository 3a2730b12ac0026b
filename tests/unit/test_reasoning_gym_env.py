"""The reasoning-gym adapter (env.name=reasoning_gym): the reward is the dataset's own scorer,
answer extraction, train / held-out items that never overlap, seeds, message mode, errors."""

from __future__ import annotations

import numpy as np
import pytest

from gyre.config import ConfigError, EnvConfig, load_config
from gyre.envs import env_factory
from gyre.envs.base import Demonstrator, is_message_env
from gyre.errors import InputError

rg = pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra is not installed")

from gyre.envs.reasoning_gym_env import EVAL_SEED_BASE, extract_answer  # noqa: E402

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def _env(**section: object):
    body = {"size": 50, "eval_size": 20, **section}
    return env_factory(EnvConfig.model_validate({"name": "reasoning_gym", "reasoning_gym": body}))()


@pytest.mark.parametrize(
    ("reply", "fmt", "expected"),
    [
        ("I think <answer> 42 </answer>", "tag", "42"),
        ("<answer>1</answer> no, <answer>2</answer>", "tag", "2"),  # the last one counts
        ("<answer>multi\nline</answer>", "tag", "multi\nline"),
        ("42", "tag", None),  # no tag: no answer
        ("<answer>42", "tag", None),  # unclosed
        ("work\n\n 17 \n\n", "last_line", "17"),
        ("  \n ", "last_line", None),
        ("  7 \n", "full", "7"),
    ],
)
def test_extract_answer_hand_cases(reply: str, fmt: str, expected: str | None) -> None:
    assert extract_answer(reply, fmt) == expected


def test_extract_answer_custom_tag() -> None:
    assert extract_answer("<final>x</final><answer>y</answer>", "tag", "final") == "x"


@pytest.mark.parametrize("name", ["basic_arithmetic", "leg_counting", "spell_backward"])
def test_reward_equals_the_datasets_own_scorer(name: str) -> None:
    env = _env(dataset=name, answer_format="full", seed=3, eval_seed=100)
    ds = rg.create_dataset(name, seed=3, size=50)
    for seed in (0, 7, 49):
        entry = ds[seed]
        assert env.reset(seed) == entry["question"] + "\n"
        for reply in (str(entry["answer"]), "0", entry["answer"] + "x", " " + entry["answer"]):
            env.reset(seed)
            _, reward, done, info = env.step(reply)
            assert done and reward == ds.score_answer(reply.strip(), entry)
            assert info["success"] == (reward >= 1.0)
            assert info["task"]["answer"] == str(entry["answer"])


def test_tag_format_scores_the_tag_and_no_tag_is_zero() -> None:
    env = _env()
    env.reset(5)
    answer = env.entry["answer"]
    _, r, _, info = env.step(f"thinking... <answer>{answer}</answer>")
    assert r == 1.0 and info["success"] and not info["malformed"]
    env.reset(5)
    _, r, _, info = env.step(answer)  # right text, but not in the tag
    assert r == 0.0 and info["malformed"]


def test_held_out_items_come_from_their_own_instance_and_never_overlap() -> None:
    env = _env(kwargs=SMALL, size=200, eval_size=150, seed=0, eval_seed=200)
    train_q = {env.reset(s) for s in range(200)}
    held_q = {env.reset(EVAL_SEED_BASE + i) for i in range(150)}
    assert not train_q & held_q
    # 1-digit sums of 2 terms: a small space, so some held-out items were dropped as repeats
    assert env.items.dropped > 0
    assert len(env.items.eval_items) + env.items.dropped == 150
    held = rg.create_dataset("basic_arithmetic", seed=200, size=150, **SMALL)
    assert env.items.eval_items[0] in [held[i] for i in range(150)]


def test_seeds_are_reproducible_and_wrap() -> None:
    a, b = _env(), _env()
    assert [a.reset(s) for s in range(60)] == [b.reset(s) for s in range(60)]
    assert a.reset(3) == a.reset(53)  # size 50: seed mod size
    assert a.reset(EVAL_SEED_BASE + 1) == b.reset(EVAL_SEED_BASE + 1)


def test_demonstrator_writes_the_format() -> None:
    env = _env()
    env.reset(2)
    rng = np.random.default_rng(0)
    expert = env.expert_action(rng)
    assert expert == f"<answer>{env.entry['answer']}</answer>"
    assert env.step(expert)[1] == 1.0
    env.reset(2)
    assert env.random_action(rng).startswith("<answer>")


def test_message_mode() -> None:
    env = _env(messages=True, prompt_template="Q: {question}")
    assert is_message_env(env)
    # SFT demonstrations are raw text: the message env offers none, so sft.steps>0 is refused
    # in one line (gyre.sft) instead of failing inside the demonstrations
    assert not isinstance(env, Demonstrator) and isinstance(_env(), Demonstrator)
    msgs = env.reset(1)
    assert msgs == [{"role": "user", "content": "Q: " + env.entry["question"]}]
    new, r, done, _ = env.step(f"<answer>{env.entry['answer']}</answer>")
    assert (new, r, done) == ([], 1.0, True)


def test_errors() -> None:
    with pytest.raises(InputError, match=r"env.reasoning_gym.dataset='nope'.*not registered"):
        _env(dataset="nope")
    with pytest.raises(InputError, match="bogus"):
        _env(kwargs={"bogus": 1})
    with pytest.raises(ConfigError, match="overlap the training items"):
        load_config(None, ["env.name=reasoning_gym", "env.reasoning_gym.eval_seed=999"])
    # seed 0, size 1000 covers reasoning-gym item seeds 0..999: 1000 is the first free one
    load_config(None, ["env.name=reasoning_gym", "env.reasoning_gym.eval_seed=1000"])
    with pytest.raises(ConfigError, match="question"):
        load_config(None, ["env.name=reasoning_gym", "env.reasoning_gym.prompt_template=hi"])
