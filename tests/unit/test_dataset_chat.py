"""Conversational prompt datasets (TRL's format): message lists as prompts, message mode, and
one-line errors naming the file, row and message."""

from __future__ import annotations

import json

import pytest

from gyre.config import EnvConfig
from gyre.envs import env_factory
from gyre.envs.base import is_message_env
from gyre.envs.data_files import load_tasks
from gyre.envs.dataset import DatasetEnv, DatasetMessageEnv
from gyre.errors import InputError


def _write(path, rows: list) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _chat(i: int) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}+1?"}]


CHAT_ROWS = [{"prompt": _chat(i), "solution": str(i + 1)} for i in range(6)]


def _env(path: str, **dataset) -> DatasetEnv:
    cfg = EnvConfig.model_validate(
        {"name": "dataset", "dataset": {"path": path, "answer_field": "solution", **dataset}}
    )
    return env_factory(cfg)()


def test_conversational_rows_make_a_message_env(tmp_path):
    env = _env(_write(tmp_path / "d.jsonl", CHAT_ROWS))
    assert isinstance(env, DatasetMessageEnv) and is_message_env(env)
    first = env.reset(2)
    assert first == _chat(2)
    first[1]["content"] = "changed"  # the env hands out copies: the task stays intact
    assert env.reset(2) == _chat(2)
    obs, reward, done, info = env.step("3")
    assert (obs, reward, done, info["success"]) == ([], 1.0, True, True)
    assert info["task"]["solution"] == "3"
    env.reset(2)
    assert env.step("4")[1] == 0.0
    env.reset(0)
    assert env.expert_action(None) == "1"  # the demonstrator serves message-mode SFT


def test_text_prompts_as_user_messages(tmp_path):
    rows = [{"prompt": f"{i}+1?", "solution": str(i + 1)} for i in range(4)]
    path = _write(tmp_path / "d.jsonl", rows)
    assert not is_message_env(_env(path))  # text stays raw text unless asked
    env = _env(path, messages=True)
    assert is_message_env(env)
    assert env.reset(1) == [{"role": "user", "content": "1+1?"}]


def test_parquet_conversational_prompt_keeps_only_set_keys(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the datasets extra is not installed")
    rows = [dict(r) for r in CHAT_ROWS]
    rows[0] = {"prompt": [*_chat(0)[:1], {"role": "tool", "content": "ok", "name": "calc"},
                          _chat(0)[1]], "solution": "1"}  # fmt: skip
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    tasks = load_tasks(path, answer_field="solution")
    # columnar storage gives every message every key (name=None); only set keys come back
    assert tasks[1].prompt == _chat(1)
    assert tasks[0].prompt[1] == {"role": "tool", "content": "ok", "name": "calc"}
    assert is_message_env(_env(str(path)))


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        ([], "field 'prompt' is an empty list of messages"),
        (["hi"], "prompt[0] must be a message {'role': ..., 'content': ...}, got 'hi'"),
        ([{"role": "robot", "content": "x"}], "prompt[0].role is 'robot'; valid: system, user"),
        ([{"role": "user", "content": ["x"]}], "prompt[0].content must be a string, got list"),
        (
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
            "the last message of 'prompt' is the assistant's",
        ),
    ],
)
def test_bad_message_names_file_row_and_message(tmp_path, prompt, needle):
    path = _write(tmp_path / "d.jsonl", [CHAT_ROWS[0], {"prompt": prompt, "solution": "1"}])
    with pytest.raises(InputError) as err:
        load_tasks(path, answer_field="solution")
    assert str(err.value).startswith(f"{path}:2: ") and needle in str(err.value)


def test_mixed_text_and_message_prompts_are_refused(tmp_path):
    path = _write(tmp_path / "d.jsonl", [*CHAT_ROWS[:2], {"prompt": "3+1?", "solution": "4"}])
    with pytest.raises(InputError, match=r"d\.jsonl:3: the prompt is text, but the first row's"):
        _env(path)
