"""The future queue: arrival order, batching of neighbours with one key, errors per request."""

from __future__ import annotations

import threading

from gyre.tinker.errors import UserError
from gyre.tinker.futures import FutureQueue


def test_neighbours_with_one_key_run_as_one_batch_in_arrival_order():
    q = FutureQueue(ttl_s=60)
    gate, calls = threading.Event(), []

    def blocker(items):
        gate.wait(10)
        calls.append(("block", items))
        return [{"ok": 1}]

    def batch(items):
        calls.append(("batch", items))
        return [{"item": i} for i in items]

    first = q.submit_batchable(None, None, blocker)
    a = q.submit_batchable("k", 1, batch)
    b = q.submit_batchable("k", 2, batch)
    c = q.submit_batchable("other", 3, batch)
    d = q.submit_batchable("k", 4, batch)  # not next to a, b: a batch of its own
    gate.set()
    assert q.wait(d, 10).payload == {"item": 4}
    assert [q.wait(r, 1).payload for r in (first, a, b, c)] == [
        {"ok": 1},
        {"item": 1},
        {"item": 2},
        {"item": 3},
    ]
    assert calls == [("block", [None]), ("batch", [1, 2]), ("batch", [3]), ("batch", [4])]
    q.close()


def test_errors_fail_their_request_and_the_worker_goes_on():
    q = FutureQueue(ttl_s=60)

    def bad():
        raise UserError("data[0].loss_fn_inputs.weights: shape [2], need [3]")

    def crash():
        raise RuntimeError("boom")

    r1, r2, r3 = q.submit(bad), q.submit(crash), q.submit(lambda: {"fine": True})
    assert q.wait(r1, 10).error == ("data[0].loss_fn_inputs.weights: shape [2], need [3]", "user")
    assert q.wait(r2, 10).error == ("internal error: RuntimeError: boom", "server")
    assert q.wait(r3, 10).payload == {"fine": True}
    q.close()


def test_forward_backward_micro_batches_stay_within_the_token_budget():
    from gyre.tinker.compute import _chunks

    assert _chunks([3, 3, 3, 3], budget=6) == [range(0, 2), range(2, 4)]
    assert _chunks([2, 10, 2], budget=8) == [range(0, 1), range(1, 2), range(2, 3)]
    assert _chunks([4, 4, 4], budget=100) == [range(0, 3)]
