"""Smoke test: ``bench/rollout.py --quick`` runs and ends with a JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "rollout.py"


def test_rollout_bench_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines, "bench printed nothing"
    report = json.loads(lines[-1])
    assert report["bench"] == "rollout"
    assert report["threads"] == 1
    for scenario in ("single_turn", "multi_turn"):
        entry = report[scenario]
        for side in ("gyre", "hf"):
            assert entry[f"{side}_tok_s"] > 0, (scenario, side, entry)
            assert entry[f"{side}_generated_tokens"] > 0, (scenario, side, entry)
        assert "ratio" in entry
    st = report["single_turn"]
    assert st["gyre_generated_tokens"] == st["hf_generated_tokens"]


VS_TRL = BENCH.parent / "vs_trl.py"
SCALING = BENCH.parent / "scaling.py"


def _last_json(script: Path, *args: str, timeout: int = 300) -> dict:
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines, "bench printed nothing"
    return json.loads(lines[-1])


def test_vs_trl_bench_quick() -> None:
    pytest.importorskip("trl", reason="TRL is a bench extra: pip install 'gyre[bench]'")
    report = _last_json(VS_TRL, "--quick")
    assert report["bench"] == "vs_trl"
    assert report["gyre_samples_per_s"] > 0 and report["trl_samples_per_s"] > 0
    assert report["samples"] == 2 * 4 * 2
    for key in ("ratio", "gyre_eval_reward", "trl_eval_reward", "eval_reward_gyre_minus_trl"):
        assert key in report


def test_vs_trl_bench_model_quick(tmp_path) -> None:
    """``--model DIR``: a tiny chat model (a ChatML template) on a prompt dataset, both sides
    from the same templated prompt ids (the bench asserts it), greedy and sampled held-out."""
    pytest.importorskip("trl", reason="TRL is a bench extra: pip install 'gyre[bench]'")
    pytest.importorskip("math_verify", reason="math_answer needs 'gyre[math]'")
    from chat_helpers import build_chat_model, build_chat_tokenizer

    tok = build_chat_tokenizer("chatml")
    build_chat_model(tok, arch="llama").save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    rows = [{"prompt": f"What is {k} + 2?", "answer": k + 2, "id": k} for k in range(14)]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = ["--model", str(tmp_path / "model"), "--tasks", str(tasks), "--quick"]
    report = _last_json(VS_TRL, *model)
    assert report["samples"] == 2 * 2 * 2 and report["train_rows"] == 4
    assert report["prompt_ids_checked"] == 2 and report["sft_steps"] == 0
    assert report["gyre_samples_per_s"] > 0 and report["trl_samples_per_s"] > 0
    for key in ("gyre_eval_reward_greedy", "trl_eval_reward_greedy", "start_eval_reward_greedy"):
        assert 0.0 <= report[key] <= 1.0
    assert report["eval_reward_greedy_gyre_minus_trl"]["verdict"] in ("equal", "better", "worse")
    # training rows and the 8 held-out ones must not overlap
    proc = subprocess.run(
        [
            sys.executable,
            str(VS_TRL),
            *model[:4],
            "--prompts",
            "2",
            "--steps",
            "4",
            "--eval-tasks",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0 and "6 rows before the 8 held-out" in proc.stderr


def test_scaling_bench_quick() -> None:
    report = _last_json(SCALING, "--quick")
    assert report["bench"] == "scaling"
    for sweep in ("batch", "seq_len"):
        points = report[sweep]
        assert len(points) >= 2
        for p in points:
            assert p["gyre_tok_s"] > 0 and p["peak_rss_mib"] > 0


@pytest.mark.slow
def test_checkpoint_bench_tiny(tmp_path) -> None:
    """``bench/checkpoint.py`` end to end on the tiny model (3 gyre processes: slow)."""
    bench = BENCH.parent / "checkpoint.py"
    tiny = [
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.intermediate_size=64",
        "sft.demos=16",
        "train.tasks_per_step=2",
        "train.group_size=2",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            str(bench),
            "--sft-steps",
            "2",
            "--steps",
            "2",
            "--threads",
            "1",
            "--workdir",
            str(tmp_path),
            *tiny,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["checkpoint_bytes"] > 0 and report["checkpoint_writes_timed"] >= 2
    assert 0 < report["share_at_every_20"] < 1
    assert report["resume_to_first_new_step_s"] > report["of_which_step_compute_s"] > 0


def test_profile_step_bench_quick() -> None:
    """``bench/profile_step.py --quick``: per-phase seconds of both sides, phases <= the step."""
    pytest.importorskip("trl", reason="TRL is a bench extra: pip install 'gyre[bench]'")
    report = _last_json(BENCH.parent / "profile_step.py", "--quick")
    assert report["bench"] == "profile_step"
    # gyre skips the forward and backward of rows whose advantage is 0, so a quick run in
    # which every group is tied (all rewards 0) times no update phase on its side
    for side, must in (("gyre", ("rollout",)), ("trl", ("generation", "forward"))):
        phases = report[side]
        assert phases["step"] > 0
        for name in must:
            assert 0 < phases[name] <= phases["step"], (side, name, phases)
        for name in ("forward", "backward"):
            assert 0 < phases.get(name, 1e-9) <= phases["step"], (side, name, phases)


AGENT = BENCH.parent / "agent.py"


def test_agent_bench_quick() -> None:
    report = _last_json(AGENT, "--quick", timeout=300)
    assert report["bench"] == "agent" and report["threads"] == 1
    for side in ("message", "raw", "hf_naive"):
        assert report[side]["tok_s"] > 0 and report[side]["generated_tokens"] > 0, side
        assert report[side]["turns"] >= 2 * 2 * 2, side  # E=2 x G=2 episodes x 2 user turns
    assert report["ratio_message_vs_raw"] > 0 and report["ratio_message_vs_hf_naive"] > 0


def test_agent_bench_maze_quick() -> None:
    args = ("--quick", "--env", "maze", "--sides", "message,hf_naive")
    report = _last_json(AGENT, *args, timeout=300)
    assert report["args"]["env"] == "maze" and "raw" not in report
    for side in ("message", "hf_naive"):
        # E=2 x G=2 conversations; a maze episode lasts until the goal or its move budget
        assert report[side]["turns"] >= 4 and report[side]["generated_tokens"] > 0, side
    assert report["ratio_message_vs_hf_naive"] > 0


def test_roofline_bench_quick() -> None:
    report = _last_json(BENCH.parent / "roofline.py", "--quick", timeout=300)
    assert report["bench"] == "roofline" and report["matmul_gflop_s"] > 0
    dec, upd = report["decode"], report["update"]
    assert dec["rows"] == 8 and dec["step_ms"] > 0 and dec["bound"] in ("compute", "memory")
    assert 0 < dec["of_bound"] and 0 < upd["of_matmul_rate"]
    assert upd["flop"] > upd["attention_flop"] > 0


def test_the_ray_benches_overrides_make_a_ray_config() -> None:
    """bench/async.py and bench/plan_calibrate.py run ``gyre train`` with no config file (the
    maze recipe, as the command line resolves it) under ``runner=ray``."""
    sys.path.insert(0, str(BENCH.parent))
    from async_common import bench_overrides
    from gyre.config import load_config
    from gyre.config.loading import default_config_path

    overrides = [*bench_overrides(0), "runner=ray", "ray.mode=one-step-off"]
    path = default_config_path(overrides)
    assert path is not None and path.name == "maze.yaml"
    cfg = load_config(path, overrides)
    assert cfg.runner == "ray" and cfg.train.level_replay.prob == 0
