"""Checkpoint helpers: ordering, resume selection, retention, atomic writes, state restore."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from gyre.checkpoint import (
    STATE_FILE,
    checkpoint_dir,
    find_resume,
    list_checkpoints,
    load_checkpoint_state,
    save_checkpoint,
)


def _fake(run_dir, name, state=True):
    d = checkpoint_dir(run_dir) / name
    d.mkdir(parents=True)
    if state:
        (d / STATE_FILE).write_text(json.dumps({"step": 0}))
    return d


def test_list_orders_by_step_number(tmp_path):
    for name in ["step_000010", "step_000009", "step_100", "step_2", "step_000011"]:
        _fake(tmp_path, name)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step_2", "step_000009", "step_000010", "step_000011", "step_100"]


def test_list_ignores_incomplete_and_temp(tmp_path):
    _fake(tmp_path, "step_000003")
    _fake(tmp_path, "step_000004", state=False)  # no state.json: incomplete
    _fake(tmp_path, ".tmp_step_000005")  # half-written
    _fake(tmp_path, "step_abc")
    _fake(tmp_path, "other")
    (checkpoint_dir(tmp_path) / "step_000006").write_text("a file, not a dir")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000003"]


def test_list_without_checkpoint_dir(tmp_path):
    assert list_checkpoints(tmp_path) == []
    assert find_resume(tmp_path, "auto") is None


def test_find_resume(tmp_path):
    for name in ["step_000009", "step_000010", "step_000002"]:
        _fake(tmp_path, name)
    _fake(tmp_path, "step_000011", state=False)
    assert find_resume(tmp_path, "auto").name == "step_000010"
    assert find_resume(tmp_path, "never") is None
    explicit = checkpoint_dir(tmp_path) / "step_000002"
    assert find_resume(tmp_path, str(explicit)) == explicit
    with pytest.raises(FileNotFoundError, match="step_000011"):
        find_resume(tmp_path, str(checkpoint_dir(tmp_path) / "step_000011"))


@pytest.fixture
def tiny(make_tiny_model):
    model = make_tiny_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # give the optimizer some state to save
    model(input_ids=torch.tensor([[1, 5, 6]])).logits.sum().backward()
    opt.step()
    return model, opt


def test_save_retention_and_contents(tmp_path, tiny, tokenizer):
    model, opt = tiny
    for step in (1, 2, 3, 4):
        path = save_checkpoint(tmp_path, step, model, tokenizer, opt, {"cursor": 10 * step}, keep=2)
        assert path.name == f"step_{step:06d}"
    kept = list_checkpoints(tmp_path)
    assert [p.name for p in kept] == ["step_000003", "step_000004"]
    leftovers = sorted(p.name for p in checkpoint_dir(tmp_path).iterdir())
    assert leftovers == ["step_000003", "step_000004"]  # no temp dirs, old ones deleted
    state = json.loads((kept[-1] / STATE_FILE).read_text())
    assert state == {"step": 4, "cursor": 40}
    assert (kept[-1] / "model" / "config.json").is_file()
    assert (kept[-1] / "optimizer.pt").is_file() and (kept[-1] / "rng.pt").is_file()


def test_resave_same_step_replaces(tmp_path, tiny, tokenizer):
    model, opt = tiny
    save_checkpoint(tmp_path, 5, model, tokenizer, opt, {"cursor": 1}, keep=3)
    save_checkpoint(tmp_path, 5, model, tokenizer, opt, {"cursor": 2}, keep=3)
    [only] = list_checkpoints(tmp_path)
    assert json.loads((only / STATE_FILE).read_text())["cursor"] == 2


def test_load_restores_optimizer_and_rng(tmp_path, tiny, tokenizer, make_tiny_model):
    model, opt = tiny
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    path = save_checkpoint(tmp_path, 7, model, tokenizer, opt, {"cursor": 3}, keep=1)
    expected = (random.random(), float(np.random.rand()), torch.rand(2))
    fresh_model = make_tiny_model(seed=0)
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=1e-3)
    state = load_checkpoint_state(path, fresh_opt)
    assert state == {"step": 7, "cursor": 3}
    got = (random.random(), float(np.random.rand()), torch.rand(2))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    saved, loaded = opt.state_dict(), fresh_opt.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for k, v in saved["state"].items():
        torch.testing.assert_close(loaded["state"][k]["exp_avg"], v["exp_avg"])
        torch.testing.assert_close(loaded["state"][k]["exp_avg_sq"], v["exp_avg_sq"])


def test_step_argument_wins_over_loaded_state(tmp_path, tiny, tokenizer):
    model, opt = tiny
    first = save_checkpoint(tmp_path, 3, model, tokenizer, opt, {"cursor": 6}, keep=5)
    state = load_checkpoint_state(first, opt)  # what loop.train does on resume
    nxt = save_checkpoint(tmp_path, 4, model, tokenizer, opt, {**state, "cursor": 8}, keep=5)
    assert json.loads((nxt / STATE_FILE).read_text())["step"] == 4
    assert find_resume(tmp_path, "auto") == nxt
