"""The Tinker loss functions on gyre's terms, against hand-computed values and gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gyre.tinker.errors import Unsupported, UserError
from gyre.tinker.losses import LOSSES, get_loss


def _run(name, lp, config=None, **inputs):
    lp = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items()}
    loss, per_token = get_loss(name)(lp, tensors, config or {})
    loss.backward()
    return loss.item(), per_token.detach().numpy(), lp.grad.numpy()


def test_cross_entropy_is_the_weighted_sum_of_token_nlls():
    lp = [math.log(0.5), math.log(0.25)]
    loss, _per_token, grad = _run("cross_entropy", lp, weights=[1.0, 2.0])
    assert loss == pytest.approx(math.log(2) + 2 * math.log(4))
    np.testing.assert_allclose(grad, [-1.0, -2.0])
    assert _run("cross_entropy", lp)[0] == pytest.approx(3 * math.log(2))  # weights default 1


def test_importance_sampling_is_minus_ratio_times_advantage():
    q = [-1.0, -2.0]
    lp = [q[0] + math.log(2), q[1] + math.log(2)]  # ratio 2 on both
    _loss, per_token, grad = _run("importance_sampling", lp, logprobs=q, advantages=[1.0, -1.0])
    np.testing.assert_allclose(per_token, [-2.0, 2.0])
    np.testing.assert_allclose(grad, [-2.0, 2.0])  # d(-rho A)/dlp = -rho A, never clipped


def test_ppo_clips_the_ratio_at_the_thresholds():
    # ratio e: A = 1 clips at 1.2 (no gradient); A = -1 keeps -e (min picks the unclipped);
    # ratio 1: plain -A.
    lp, q = [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]
    _loss, per_token, grad = _run("ppo", lp, logprobs=q, advantages=[1.0, -1.0, 2.0])
    np.testing.assert_allclose(per_token, [-1.2, math.e, -2.0])
    np.testing.assert_allclose(grad, [0.0, math.e, -2.0])
    cfg = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    assert _run("ppo", [1.0], cfg, logprobs=[0.0], advantages=[1.0])[0] == pytest.approx(-1.1)


def test_cispo_clips_the_weight_but_keeps_every_gradient():
    lp, q = [1.0, -0.5], [0.0, -0.5]  # ratios e (clipped to 1.2) and 1
    _loss, per_token, grad = _run("cispo", lp, logprobs=q, advantages=[1.0, 2.0])
    np.testing.assert_allclose(per_token, [-1.2 * 1.0, -1.0 * 2.0 * -0.5])  # -sg(w) A lp
    np.testing.assert_allclose(grad, [-1.2, -2.0])


def test_gspo_uses_one_sequence_ratio_with_each_tokens_gradient():
    lp, q = [0.2, 0.0, 5.0], [0.0, 0.0, 0.0]
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    mask = [1.0, 1.0, 0.0]  # the third token is outside the ratio (and has A = 0)
    _loss, per_token, grad = _run(
        "gspo", lp, cfg, logprobs=q, advantages=[1.0, 1.0, 0.0], sequence_ratio_mask=mask
    )
    s = math.exp(0.1)  # mean log-ratio over the masked tokens
    np.testing.assert_allclose(per_token, [-s, -s, 0.0])
    np.testing.assert_allclose(grad, [-s, -s, 0.0])
    # the paper's tight default clip: s = e^0.1 is far outside [1 - 3e-4, 1 + 4e-4]
    _, _, clipped = _run("gspo", lp, logprobs=q, advantages=[1.0, 1.0, 0.0])
    np.testing.assert_allclose(clipped, [0.0, 0.0, 0.0])


def test_dro_is_reward_weighted_logprob_with_a_quadratic_penalty():
    loss, _, grad = _run("dro", [-1.0], {"beta": 0.5}, logprobs=[-2.0], advantages=[2.0])
    assert loss == pytest.approx(2.0 + 0.5 * 0.5 * 1.0)  # -(lp A) + beta (lp - q)^2 / 2
    np.testing.assert_allclose(grad, [-2.0 + 0.5 * 1.0])


def test_unsupported_and_bad_inputs_name_the_reason_and_the_field():
    with pytest.raises(Unsupported, match="stability info"):
        _run("stable_reinforce", [0.0], logprobs=[0.0], advantages=[0.0])
    with pytest.raises(UserError, match=r"loss_fn_config\.loss_id"):
        _run("custom", [0.0])
    with pytest.raises(UserError, match="valid: cross_entropy, importance_sampling"):
        get_loss("nope")
    with pytest.raises(UserError, match=r"loss_fn_inputs\.advantages"):
        _run("ppo", [0.0], logprobs=[0.0])
    with pytest.raises(UserError, match=r"loss_fn_inputs\.logprobs has shape \[2\]"):
        _run("importance_sampling", [0.0], logprobs=[0.0, 0.0], advantages=[0.0])
    with pytest.raises(UserError, match="clip_low_threshold"):
        _run("ppo", [0.0], {"clip_low_threshold": 1.5}, logprobs=[0.0], advantages=[0.0])
    assert set(LOSSES) >= {"cross_entropy", "ppo", "cispo", "dro", "gspo", "custom"}


def test_wire_round_trip_with_the_sdks_own_encoders():
    """Our decoder reads what the SDK writes (dense and sparse 2-D); the SDK reads our output."""
    pytest.importorskip("tinker")
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output

    from gyre.tinker.wire import decode_forward_backward, encode_forward_backward_output

    targets = torch.tensor([[1, 0], [0, 3], [2, 2]])
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([7, 8, 9]),
        loss_fn_inputs={"target_tokens": targets, "weights": (targets > 0).float()},
    )
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="cross_entropy", loss_fn_config={"beta": 0.5, "mode": "x"}
        ),
        model_id="m",
        seq_id=3,
    )
    call = decode_forward_backward(forward_backward_request_to_proto(req).SerializeToString())
    assert (call.model_id, call.seq_id, call.loss_fn) == ("m", 3, "cross_entropy")
    assert call.loss_fn_config == {"beta": 0.5, "mode": "x"}
    assert call.data[0].tokens == [7, 8, 9]
    np.testing.assert_array_equal(call.data[0].inputs["target_tokens"], targets.numpy())
    out = [{"logprobs": np.array([-1.0, -2.0], np.float32)}, {"logprobs": np.zeros(3, np.float32)}]
    back = deserialize_forward_backward_output(encode_forward_backward_output(out, {"l": 1.5}))
    assert back.metrics == {"l": 1.5}
    assert back.loss_fn_outputs[0]["logprobs"].tolist() == [-1.0, -2.0]
    assert back.loss_fn_outputs[1]["logprobs"].shape == [3]
