"""The JSONL prompt-dataset env: rows, the held-out split, and errors naming file and line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gyre.config import EnvConfig
from gyre.envs import DatasetEnv, env_factory, load_jsonl_tasks
from gyre.envs.dataset import EVAL_SEED_BASE as DATASET_EVAL_BASE
from gyre.rollout.evaluate import EVAL_SEED_BASE, train_seed


def _write(path, rows: list) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


ROWS = [{"prompt": f"{i}+1=", "answer": i + 1, "level": i % 2} for i in range(10)]


def test_rows_load_and_score(tmp_path):
    tasks = load_jsonl_tasks(_write(tmp_path / "d.jsonl", ROWS))
    env = DatasetEnv(tasks)
    assert env.reset(3) == "3+1="
    obs, r, done, info = env.step(" 4\n")
    assert (obs, r, done) == ("", 1.0, True)
    assert info["success"] is True
    assert info["task"] == {"answer": "4", "level": 1}  # numbers become text; extras kept
    env.reset(3)
    assert env.step("5")[1] == 0.0
    with pytest.raises(RuntimeError, match="reset"):
        env.step("4")


def test_eval_rows_are_never_training_rows(tmp_path):
    tasks = load_jsonl_tasks(_write(tmp_path / "d.jsonl", ROWS))
    env = DatasetEnv(tasks, eval_rows=3)
    assert DATASET_EVAL_BASE == EVAL_SEED_BASE
    train_rows = {env.row_index(train_seed(0, 2, k)) for k in range(500)}
    eval_rows = {env.row_index(EVAL_SEED_BASE + i) for i in range(20)}
    assert train_rows == set(range(7)) and eval_rows == {7, 8, 9}
    with pytest.raises(ValueError, match="eval_rows=10 leaves no training rows"):
        DatasetEnv(tasks, eval_rows=10)


def test_demonstrator_for_sft(tmp_path):
    env = DatasetEnv(load_jsonl_tasks(_write(tmp_path / "d.jsonl", ROWS)))
    env.reset(5)
    assert env.expert_action(np.random.default_rng(0)) == "6"
    assert env.random_action(np.random.default_rng(0)) in {str(i + 1) for i in range(10)}


def test_custom_field_names_and_factory(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"question": "2*3=", "solution": "6"}])
    cfg = EnvConfig.model_validate(
        {
            "name": "dataset",
            "dataset": {"path": path, "prompt_field": "question", "answer_field": "solution"},
        }
    )
    env = env_factory(cfg)()
    assert env.reset(123) == "2*3="
    assert env.step("6")[2:] == (
        True,
        {"success": True, "moves": 1, "malformed": False, "task": {"solution": "6"}},
    )


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ("{not json", "not valid JSON"),
        ('["prompt", "answer"]', "a row must be a JSON object, got list"),
        ('{"prompt": "1+1="}', "missing field 'answer'"),
        ('{"answer": "2"}', "missing field 'prompt'"),
        ('{"prompt": 5, "answer": "2"}', "field 'prompt' must be a non-empty string"),
        ('{"prompt": "x", "answer": [2]}', "field 'answer' must be a string or a number"),
        ('{"prompt": "x", "answer": true}', "field 'answer' must be a string or a number"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, bad, needle):
    # line 1 good, line 2 blank (skipped but counted), line 3 bad
    path = _write(tmp_path / "tasks.jsonl", [ROWS[0], "", bad, ROWS[1]])
    with pytest.raises(ValueError) as err:
        load_jsonl_tasks(path)
    assert str(err.value).startswith(f"{path}:3: ")
    assert needle in str(err.value)


def test_missing_or_empty_file(tmp_path):
    with pytest.raises(ValueError, match=r"env\.dataset\.path is empty"):
        load_jsonl_tasks("")
    with pytest.raises(ValueError, match="does not exist"):
        load_jsonl_tasks(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no rows"):
        load_jsonl_tasks(tmp_path / "empty.jsonl")
