"""The optimizer-state conversion of whole-model FSDP2 checkpoints (gyre.trainer.fsdp_checkpoint):
torch's name-keyed full optimizer state <-> the positional ``Optimizer.state_dict()`` that a
one-process run writes to ``optimizer.pt``, checked against a real AdamW after real steps."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from gyre.trainer.fsdp_checkpoint import (
    ShardedOptimizerLoad,
    _indexed,
    _named,
    _optimizer_names,
    gather,
)


def _stepped(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    model[0].bias.requires_grad_(False)  # a frozen parameter has no optimizer slot
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 0.1}])
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_name_keyed_state_converts_to_the_positional_one_and_back():
    model, opt = _stepped(0)
    named = get_optimizer_state_dict(model, opt)  # what the gather yields, for one process
    assert set(named["state"]) == {"0.weight", "2.weight", "2.bias"}
    own = opt.state_dict()
    got = _indexed(named)
    assert got["param_groups"] == own["param_groups"]
    assert set(got["state"]) == set(own["state"])
    for i, s in own["state"].items():
        for k, v in s.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    names = _optimizer_names(model, opt)
    assert names == ["0.weight", "2.weight", "2.bias"]
    back = _named(own, names)
    assert back["param_groups"] == named["param_groups"]


def test_loading_the_positional_state_restores_another_optimizer_exactly():
    model, opt = _stepped(0)
    fresh_model, fresh = _stepped(1)  # other weights and moments, same shapes
    fresh_model.load_state_dict(model.state_dict())
    ShardedOptimizerLoad(fresh_model, fresh).load_state_dict(opt.state_dict())
    mine, theirs = opt.state_dict()["state"], fresh.state_dict()["state"]
    for a, b in zip(mine.values(), theirs.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_mismatched_optimizer_file_is_one_line():
    model, opt = _stepped(0)
    state = opt.state_dict()
    state["param_groups"][1]["params"] = state["param_groups"][1]["params"][:1]
    try:
        _named(state, _optimizer_names(model, opt))
    except ValueError as exc:
        assert "holds 2 parameters; this model trains 3" in str(exc)
    else:
        raise AssertionError("not refused")


def test_a_gathered_state_is_a_snapshot_that_later_steps_leave_alone():
    model, opt = _stepped(0)
    full, named = gather(model, opt)  # no process group: one process, nothing sharded
    before = {n: {k: v.clone() for k, v in s.items()} for n, s in named["state"].items()}
    weights = {k: v.clone() for k, v in full.items()}
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()  # AdamW increments its step counters in place
    for n, s in named["state"].items():
        assert all(torch.equal(v, before[n][k]) for k, v in s.items()), n
    assert all(torch.equal(full[k], weights[k]) for k in weights)
    assert opt.state_dict()["state"][0]["step"].item() == 3 and before["0.weight"]["step"] == 2
