"""``train.source``: reading a ``gyre serve --record`` recording, its checks and its groups."""

from __future__ import annotations

import json

import pytest

from gyre.config import Config, load_config
from gyre.rollout.recorded import RECORD_SCHEMA, RecordedSource, group_records, read_records


def _rec(group: str, reward: float = 1.0, **kw) -> dict:
    seg = {"token_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1],
           "rollout_logprobs": [0.0, 0.0, -0.5, -0.25], "turn_spans": [[2, 4]]}  # fmt: skip
    rec = {"schema": RECORD_SCHEMA, "session": f"{group}-{reward}", "group": group,
           "reward": reward, "temperature": 1.0, "top_p": 1.0, "num_calls": 1,
           "policy_version": 0, "segments": [seg]}  # fmt: skip
    rec.update(kw)
    return rec


def _write(path, recs) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_groups_are_cut_to_group_size_in_first_appearance_order(tmp_path):
    recs = [_rec("b", 0), _rec("a", 1), _rec("b", 1), _rec("a", 0), _rec("b", 0.5), _rec("b")]
    recs.append(_rec("b", 0.25))
    groups, left = group_records(recs, 2)
    assert [[r["group"] for r in g] for g in groups] == [["b", "b"], ["b", "b"], ["a", "a"]]
    assert left == 1
    _write(tmp_path / "episodes.jsonl", recs)
    src = RecordedSource(tmp_path, 2, vocab=10, temperature=1.0, top_p=1.0)
    trajs = src.play([0, 4])  # task 4 wraps around to group 1
    assert [t.group_id for t in trajs] == [0, 0, 4, 4]
    assert [t.reward for t in trajs] == [0.0, 1.0, 0.5, 1.0]
    assert [t.traj_id for t in trajs] == ["0:0", "0:1", "4:0", "4:1"]
    assert trajs[0].loss_mask == [0, 0, 1, 1] and trajs[0].turn_spans == [(2, 4)]
    assert "7 recorded episodes -> 3 groups of 2; 1 left out" in src.describe()


def test_recorded_rows_are_served_at_the_runs_policy_version(tmp_path):
    """A recording is data, not a stale rollout: its rows carry the version they are trained
    at (so the Ray runner's staleness check never drops them), the served one in info; a
    rewritten episode's step rows too."""
    seg2 = {"token_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "rollout_logprobs": [0.0, -1.0, -2.0]}
    two = _rec("a", 1.0, policy_version=2)
    two["segments"] = [*two["segments"], seg2]
    _write(tmp_path / "episodes.jsonl", [_rec("a", 0.0, policy_version=2), two])
    src = RecordedSource(tmp_path, 2, vocab=10, temperature=1.0, top_p=1.0)
    trajs = src.play([0], version=7)
    assert [t.policy_version for t in trajs] == [7, 7]
    assert [t.info["recorded_policy_version"] for t in trajs] == [2, 2]
    assert trajs[1].steps is not None and [s.policy_version for s in trajs[1].steps] == [7, 7]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"temperature": 0.7}, "sampled with temperature=0.7"),
        ({"temperature": None}, "it changed within the episode"),
        ({"reward": "x"}, "reward 'x' is not a finite number"),
        ({"schema": "other"}, "not a gyre.recorded/1 record"),
        ({"segments": [{"token_ids": [1, 2], "loss_mask": [0], "rollout_logprobs": [0, 0]}]},
         "segments[0]: token_ids, loss_mask and rollout_logprobs differ in length"),
        ({"segments": [{"token_ids": [1, 99], "loss_mask": [0, 1], "rollout_logprobs": [0, -1]}]},
         "token_ids[1]=99 is outside the vocab [0, 10)"),
        ({"segments": [{"token_ids": [1, 2], "loss_mask": [0, 0], "rollout_logprobs": [0, 0]}]},
         "no sampled token"),
    ],
)  # fmt: skip
def test_bad_records_name_file_and_line(tmp_path, change, message):
    f = tmp_path / "episodes.jsonl"
    _write(f, [_rec("a"), _rec("a", **change)])
    with pytest.raises(ValueError, match=r"episodes\.jsonl:2: ") as err:
        read_records(tmp_path, 10, 1.0, 1.0)
    assert message in str(err.value)


def test_no_full_group_says_what_to_do(tmp_path):
    _write(tmp_path / "x.jsonl", [_rec("a"), _rec("b")])
    with pytest.raises(ValueError, match=r"train\.group_size=2") as err:
        RecordedSource(tmp_path / "x.jsonl", 2, 10, 1.0, 1.0)
    assert "gyre_group" in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        RecordedSource(tmp_path / "empty", 2, 10, 1.0, 1.0)


def test_config_defaults_under_train_source():
    cfg = load_config(None, ["train.source=rec", "model.path=m"])
    assert cfg.sft.steps == 0 and cfg.train.algo.rollout_is == "truncate"
    named = load_config(None, ["train.source=rec", "model.path=m", "train.algo.rollout_is=none"])
    assert named.train.algo.rollout_is == "none"
    assert Config().sft.steps == 40 and Config().train.algo.rollout_is == "none"  # unchanged
    with pytest.raises(Exception, match=r"train\.source needs model\.path"):
        load_config(None, ["train.source=rec"])
    with pytest.raises(Exception, match=r"sft\.steps must be 0"):
        load_config(None, ["train.source=rec", "model.path=m", "sft.steps=5"])
