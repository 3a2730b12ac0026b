"""``gyre plan``: the step-time model with hand numbers, the best split, measuring a run."""

from __future__ import annotations

import json

import pytest

from gyre.cli import main
from gyre.commands.plan import Throughputs, Workload, calibrate, measure, plan, predict

# g = 100 tok/s per engine, t = 300 tok/s per rank, 2 s per GB; R = 1200, T = 1800 tokens, 1 GB
TP = Throughputs(100.0, 300.0, 2.0, overhead_s=0.5, handover_s=1.0)
WL = Workload(1200.0, 1800.0, 1.0)


def test_hand_computed_step_times():
    # 4 nodes. colocated: gen 1200/(100*4) = 3, train 1800/(300*4) = 1.5, sync 2, h 1, o 0.5
    c = predict(TP, WL, "colocated", 4)
    assert (c.gen_s, c.train_s, c.sync_s, c.step_s) == (3.0, 1.5, 2.0, 8.0)
    assert c.util_rollout == c.util_trainer == pytest.approx(4.5 / 8) and c.idle_frac == 0.4375
    # 3 rollout + 1 trainer: gen 4, train 6, sync 2
    d = predict(TP, WL, "disaggregated", 4, 3)
    assert (d.gen_s, d.train_s, d.step_s) == (4.0, 6.0, 12.5)
    assert d.idle_frac == pytest.approx(1 - (3 * 4 + 1 * 6) / (4 * 12.5))
    o = predict(TP, WL, "one-step-off", 4, 3)
    # the driver's own 0.5 s lies on the trainer's path: max(4, 6 + 2 + 0.5)
    assert o.step_s == 8.5 and o.util_trainer == pytest.approx(6 / 8.5)
    assert predict(TP, WL, "async", 4, 3).step_s == o.step_s


def test_best_split_and_refusals():
    preds = plan(TP, WL, 4)
    assert [p.step_s for p in preds] == sorted(p.step_s for p in preds)
    best = {p.mode: p for p in preds}
    # one-step-off: r=1: max(12, 2+2+.5)=12; r=2: max(6, 3+2+.5)=6; r=3: max(4, 6+2+.5) -> r=2
    assert best["one-step-off"].rollout_nodes == 2 and best["one-step-off"].step_s == 6.0
    assert preds[0].mode == "one-step-off"
    with pytest.raises(ValueError, match="needs 1 <= rollout nodes < 4"):
        predict(TP, WL, "one-step-off", 4, 4)
    with pytest.raises(ValueError, match="valid: colocated"):
        predict(TP, WL, "pipelined", 4, 2)


def _run_rows(step_s: float, **calls: float) -> list[dict]:
    rows = [{"step": 1, "train/loss": 0.0}]  # the first step is left out (start-up)
    for step in (2, 3, 4):
        rows.append({
            "step": step, "train/loss": 0.1, "perf/samples_per_s": 32.0 / step_s,
            "time/step_s": step_s, "rollout/response_tokens_mean": 10.0,
            "time/gen_actor_s": 0.8, "train/tokens": 600.0, "time/trainer_update_s": 1.0,
            "sync/bytes": 1e8, "time/sync_gather_s": 0.05, "time/sync_load_s": 0.05, **calls,
        })  # fmt: skip
    return rows


def test_measure_reads_a_runs_metrics_and_the_cli_prints_the_best(tmp_path, capsys):
    rows = _run_rows(2.0)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tp, wl = measure(tmp_path)
    # 32 samples x 10 tokens in 0.75 s: the rollout calls' 0.8 s less the 0.05 s weight load,
    # which is counted once, as sync (gather 0.05 + load 0.05 for 0.1 GB)
    assert wl.rollout_tokens == 320.0 and tp.rollout_tokens_per_s == pytest.approx(320 / 0.75)
    assert tp.trainer_tokens_per_s == 600.0 and tp.sync_s_per_gb == pytest.approx(1.0)
    assert tp.overhead_s == pytest.approx(2.0 - 0.75 - 1.0 - 0.1)  # no call timings: all is o
    assert tp.rollout_call_s == tp.train_call_s == 0.0
    # the run itself (1 + 1, sync) is predicted as measured
    assert predict(tp, wl, "disaggregated", 2, 1).step_s == pytest.approx(2.0)
    assert main(["plan", str(tmp_path), "--nodes", "2"]) == 0
    # colocated on both nodes: gen 0.75/2, train 1.0/2, sync 0.1, o 0.15
    assert "best over 2 nodes: colocated, all nodes both roles: 1.125 s" in capsys.readouterr().out
    assert main(["plan", "--nodes", "2"]) == 1
    assert "--rollout-tokens-per-s must be > 0" in capsys.readouterr().err


def test_the_call_overheads_sit_on_their_own_paths(tmp_path):
    """With the loop's call timings, the overhead splits into the rollout call's (on the
    generation path), the update call's and the driver's own (on the trainer's path), so an
    overlapped mode is not charged the whole overhead on top of the slower role."""
    rows = _run_rows(2.3, **{"time/rollout_s": 0.9, "time/train_s": 1.2})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tp, wl = measure(tmp_path)
    assert tp.rollout_call_s == pytest.approx(0.1)  # 0.9 waited - 0.8 inside the calls
    assert tp.train_call_s == pytest.approx(0.15)  # 1.2 - 1.0 update - 0.05 gather
    assert tp.overhead_s == pytest.approx(2.3 - 0.9 - 1.2)
    assert predict(tp, wl, "disaggregated", 2, 1).step_s == pytest.approx(2.3)
    # one-step-off 1 + 1: max(0.75 + 0.1, 1.0 + 0.15 + 0.1 + 0.2) = 1.45
    assert predict(tp, wl, "one-step-off", 2, 1).step_s == pytest.approx(1.45)


def test_a_colocated_runs_hand_over_is_measured_as_h(tmp_path):
    """The hand-over's seconds (the engines' release, the trainer's offload and load) sit
    inside the update call; they come out of c_t as h, which only the colocated row pays."""
    hand = {"handover/release_s": 0.1, "handover/trainer_offload_s": 0.03,
            "handover/trainer_load_s": 0.02, "handover/optimizer_offload_bytes": 5e6}  # fmt: skip
    rows = _run_rows(2.45, **{"time/rollout_s": 0.9, "time/train_s": 1.35, **hand})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tp, wl = measure(tmp_path)
    assert tp.handover_s == pytest.approx(0.15)  # the bytes are not seconds
    assert tp.train_call_s == pytest.approx(0.15)  # 1.35 - 1.0 - 0.05 gather - 0.15 h
    assert tp.overhead_s == pytest.approx(2.45 - 0.9 - 1.35)
    # the run itself, colocated on one node, is predicted as measured
    assert predict(tp, wl, "colocated", 1).step_s == pytest.approx(2.45)
    assert predict(tp, wl, "disaggregated", 2, 1).step_s == pytest.approx(2.3)


def _write_run(path, rows: list[dict], tasks: int, workers: int = 1, ranks: int = 1) -> None:
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ray = f"ray:\n  rollout_workers: {workers}\n  trainer_ranks: {ranks}\n  tasks_per_share: 0\n"
    (path / "config.yaml").write_text(f"train:\n  tasks_per_step: {tasks}\n{ray}")


def test_two_batch_sizes_separate_the_fixed_seconds_of_a_call_and_a_rank(tmp_path, capsys):
    """An engine call costs a_g + tokens / g and a rank's update a_t + tokens / t. Runs of two
    batch sizes give both; the planner then predicts that half a batch on each of two engines
    takes longer than half the time."""
    # g = 1000 tok/s with a_g = 0.2 s; t = 500 tok/s with a_t = 0.1 s; 32 samples x 10 tokens
    small = _run_rows(
        2.0,
        **{
            "time/gen_actor_s": 0.2 + 320 / 1000 + 0.05,
            "train/tokens": 320.0,
            "time/trainer_update_s": 0.1 + 320 / 500,
        },
    )
    # twice the batch (64 samples): the same fixed seconds, twice the work
    big = _run_rows(
        2.0,
        **{
            "time/gen_actor_s": 0.2 + 640 / 1000 + 0.05,
            "train/tokens": 640.0,
            "time/trainer_update_s": 0.1 + 640 / 500,
        },
    )
    for r in big[1:]:
        r["perf/samples_per_s"] = 64 / 2.0
    # and a run of two engines and two ranks, one call each (160 tokens per call and per rank)
    two = _run_rows(
        2.0,
        **{
            "time/gen_actor_s": 2 * (0.2 + 160 / 1000) + 0.05,
            "train/tokens": 320.0,
            "time/trainer_update_s": 0.1 + 160 / 500,
        },
    )
    _write_run(tmp_path / "small", small, tasks=4)
    _write_run(tmp_path / "big", big, tasks=8)
    _write_run(tmp_path / "two", two, tasks=4, workers=2, ranks=2)
    tp, wl = calibrate([tmp_path / "small", tmp_path / "big", tmp_path / "two"])
    assert (tp.rollout_fixed_s, tp.rollout_tokens_per_s) == pytest.approx((0.2, 1e3))
    assert (tp.trainer_fixed_s, tp.trainer_tokens_per_s) == pytest.approx((0.1, 500))
    assert wl.rollout_tokens == 320.0  # the step's work comes from the first run
    # colocated on 2 nodes: gen 0.2 + 320 / 2000, train 0.1 + 320 / 1000, not half of one node's
    c2 = predict(tp, wl, "colocated", 2)
    assert (c2.gen_s, c2.train_s) == pytest.approx((0.36, 0.42))
    one, _ = measure(tmp_path / "small")  # one run: the fixed seconds folded into the rates
    assert one.rollout_fixed_s == one.trainer_fixed_s == 0.0
    assert predict(one, wl, "colocated", 2).gen_s == pytest.approx((0.2 + 0.32) / 2)
    assert main(["plan", str(tmp_path / "small"), str(tmp_path / "big"), "--nodes", "2"]) == 0
    assert "best over 2 nodes" in capsys.readouterr().out


def test_runs_of_one_batch_size_cannot_separate_the_fixed_seconds(tmp_path):
    for name in ("a", "b"):
        _write_run(tmp_path / name, _run_rows(2.0), tasks=4)
    with pytest.raises(ValueError, match=r"same work per engine call .*\(train.tasks_per_step\)"):
        calibrate([tmp_path / "a", tmp_path / "b"])
    (tmp_path / "a" / "config.yaml").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.yaml: no config"):
        calibrate([tmp_path / "a", tmp_path / "b"])
