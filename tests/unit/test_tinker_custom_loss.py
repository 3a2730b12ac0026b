"""Uploaded custom losses: graphs the SDK encodes, checked and run against hand values."""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("tinker")
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from gyre.tinker.compute import CustomRun
from gyre.tinker.custom_loss import compile_custom_loss
from gyre.tinker.errors import UserError


def clipped_pg(logprobs, sampled, advantages):
    ratio = torch.exp(logprobs - sampled)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    n = logprobs.shape[0]
    return loss, {"custom/ratio:mean": ratio.mean().detach(), "custom/tokens:sum": n + 0 * loss}


def scaled_nll(logprobs, weights, scale):
    loss = -(logprobs * weights).sum() * scale + math.log(1.0)
    return loss, {"custom/nll:sum": loss.detach()}


def _body(fn, ranks) -> dict:
    handle = trace_loss(fn, ranks, "session")
    return {
        "name": handle.name,
        "inputs": [i.model_dump() for i in handle.inputs],
        "graph": encode_graph(handle).model_dump(),
    }


def test_an_encoded_loss_runs_with_its_hand_values_gradient_and_metrics():
    loss = compile_custom_loss(_body(clipped_pg, {"logprobs": 1, "sampled": 1, "advantages": 1}))
    q = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    lp = (q + torch.tensor([math.log(2.0), 0.0], dtype=torch.float64)).requires_grad_(True)
    value, metrics = loss(lp, {"sampled": q, "advantages": torch.tensor([1.0, -1.0]).double()})
    value.backward()
    # token 0: ratio 2 clipped to 1.2 with A = 1 (no gradient); token 1: ratio 1, A = -1
    assert value.item() == pytest.approx(-(1.2 - 1.0))
    assert lp.grad.tolist() == pytest.approx([0.0, 1.0])
    assert metrics["custom/ratio:mean"].item() == pytest.approx(1.5)
    assert metrics["custom/tokens:sum"].item() == 2


def test_metrics_sum_or_average_over_datums_and_ranks_are_checked():
    run = CustomRun(
        compile_custom_loss(_body(scaled_nll, {"logprobs": 1, "weights": 1, "scale": 0})), 2
    )
    for lp in ([-1.0, -2.0], [-3.0, 0.0]):
        inputs = {"weights": torch.tensor([1.0, 1.0]), "scale": torch.tensor([2.0])}
        value, per_token = run(torch.tensor(lp), inputs, {})
        assert per_token is None
    assert value.item() == pytest.approx(6.0)  # -(−3 + 0) * 2
    assert run.metrics() == {"custom/nll:sum": pytest.approx(6.0 + 6.0)}
    with pytest.raises(UserError, match=r"loss_fn_inputs\.weights: rank 2, .* rank 1"):
        run(torch.zeros(2), {"weights": torch.zeros(2, 1), "scale": torch.tensor(1.0)}, {})
    with pytest.raises(UserError, match=r"loss_fn_inputs\.scale: required"):
        run(torch.zeros(2), {"weights": torch.zeros(2)}, {})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda n: n[3].update(target="torch.save"), r"nodes\[3\] \(sub\): function 'torch.save'"),
        (lambda n: n[3].update(target="os.system"), "'os.system' is not allowed"),
        (lambda n: n[3].update(op="call_method", target="item"), "method 'item' is not allowed"),
        (lambda n: n[3].update(op="call_method", target="add_"), "method 'add_' is not allowed"),
        (lambda n: n[3].update(op="call_module"), "op 'call_module' is not allowed"),
        (lambda n: n[3].update(args=[{"ref": "later"}]), "'later', which is not an earlier"),
        (lambda n: n[3].update(args=[{"dtype": "save"}]), "'save' is not a torch dtype"),
        (lambda n: n[3].update(args=[{"code": "x"}]), "cannot decode argument"),
        (lambda n: n.pop(), "the last node, and only it, must be the output"),
    ],
)
def test_anything_outside_the_allow_lists_is_refused_naming_the_node(edit, message):
    body = _body(clipped_pg, {"logprobs": 1, "sampled": 1, "advantages": 1})
    edit(body["graph"]["nodes"])
    with pytest.raises(UserError, match=message):
        compile_custom_loss(body)


def test_attribute_reads_and_metric_names_are_limited():
    body = _body(clipped_pg, {"logprobs": 1, "sampled": 1, "advantages": 1})
    bad = copy.deepcopy(body)
    node = next(n for n in bad["graph"]["nodes"] if n["target"] == "getattr")
    node["args"][1] = "__class__"
    with pytest.raises(UserError, match="reads an attribute other than"):
        compile_custom_loss(bad)
    bad = copy.deepcopy(body)
    metrics = bad["graph"]["nodes"][-1]["args"][0]["tuple"][1]["dict"]
    metrics["loss:sum"] = metrics.pop("custom/ratio:mean")
    with pytest.raises(UserError, match="metric 'loss:sum' must be custom/<name>:sum or :mean"):
        compile_custom_loss(bad)
    with pytest.raises(UserError, match=r"inputs\[0\]: must be logprobs"):
        compile_custom_loss({**body, "inputs": [{"name": "weights", "rank": 1}]})


def test_a_node_that_fails_at_run_time_is_a_user_error_naming_it():
    body = _body(clipped_pg, {"logprobs": 1, "sampled": 1, "advantages": 1})
    nodes = body["graph"]["nodes"]
    assert any(n["name"] == "getitem" for n in nodes)  # shape[0], a Python int
    bad = {"op": "call_method", "name": "bad", "target": "sum", "args": [{"ref": "getitem"}]}
    nodes.insert(len(nodes) - 1, {**bad, "kwargs": {}})
    loss = compile_custom_loss(body)
    z = torch.zeros(2)
    with pytest.raises(UserError, match=r"custom loss 'clipped_pg', node 'bad': .*sum"):
        loss(z, {"sampled": z, "advantages": z})
