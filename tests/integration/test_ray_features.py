"""Every former "not supported with runner=ray" refusal, as a Ray run on the local 2-CPU cluster.

- LoRA (adapter sync to the workers) together with reward functions (one of them sandboxed):
  bitwise the same metrics and weights as ``runner=local`` in sync mode.
- GAE with a critic: bitwise the same as ``runner=local``.
- DAPO dynamic sampling: every trained group has reward variance, the dropped ones are logged.
- ``engine.kind=http``: rollout workers drive a ``gyre serve`` server whose weights the trainer
  rank pushes every step.
- The default placement (3 CPUs) fits itself to the 2-CPU cluster, and the fault limits stop a
  Ray run exactly as they stop a local one.
- ``train.source``: a recording (the ``gyre serve --record`` schema) trains the same under Ray
  as locally, bitwise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from gyre import loop, runners, sft  # noqa: E402
from gyre.checkpoint.resume import FaultAbort  # noqa: E402
from gyre.config import load_config  # noqa: E402
from serve_helpers import start_server  # noqa: E402

TINY = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.intermediate_size=64",
    "log.console=off",
    "run.threads=1",
    "env.name=arithmetic",
    "env.arithmetic.max_operand=3",
    "env.arithmetic.ops=+",
    "train.sampling.max_new_tokens=3",
]
STEPS, TASKS, GROUP = 3, 4, 4
SKIP_PREFIXES = ("time/", "perf/", "sync/", "async/", "recovery/", "handover/")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    tmp = tmp_path_factory.mktemp("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=str(tmp),
             namespace="gyre-tests", log_to_driver=False)  # fmt: skip
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> Path:
    """A short SFT warm start: rewards vary, so the updates are real."""
    d = tmp_path_factory.mktemp("warm")
    cfg = load_config(None, [*TINY, f"run.dir={d}", "sft.steps=40", "sft.demos=200",
                             "sft.batch_size=16", "sft.lr=0.01"])  # fmt: skip
    run_dir, device = loop.setup(cfg)
    return sft.run_sft(cfg, run_dir, device, loop.base_model_path(cfg, run_dir))


def _cfg(run_dir: Path, model: Path, *extra: str, ray_on: bool = True):
    ov = [*TINY, f"run.dir={run_dir}", f"model.path={model}", "sft.steps=0",
          f"train.steps={STEPS}", f"train.tasks_per_step={TASKS}", f"train.group_size={GROUP}",
          "train.mini_batches=2", "train.lr=0.01", "eval.episodes=8",
          "checkpoint.every=0"]  # fmt: skip
    if ray_on:  # one share per step: the same sampling seeds as the local runner
        ov += ["runner=ray", f"ray.tasks_per_share={TASKS}"]
    return load_config(None, [*ov, *extra])


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(SKIP_PREFIXES)} for r in rows]


def _same_as_local(ray_dir: Path, local_dir: Path) -> None:
    a, b = _comparable(_metrics(ray_dir)), _comparable(_metrics(local_dir))
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        shared = ra.keys() & rb.keys()
        assert {k: ra[k] for k in shared} == {k: rb[k] for k in shared}
    assert any(r.get("train/grad_norm", 0) > 0 for r in a), "the policy must move"
    wa, wb = (_weights(d / "final") for d in (ray_dir, local_dir))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


LORA_REWARDS = [
    "model.lora={rank: 4, alpha: 8}",
    "train.kl_coef=0.01",
    "reward.functions=[{fn: 'reward_fixtures:length', weight: 0.1},"
    " {fn: 'reward_fixtures:constant', weight: 0.5, sandbox: true, kwargs: {value: 0.2}}]",
    "reward.sandbox.network=allow",
]


def test_lora_and_reward_functions_under_ray_match_local(ray_cluster, warm, tmp_path):
    a, b = tmp_path / "ray", tmp_path / "local"
    s = runners.train(_cfg(a, warm, *LORA_REWARDS))
    runners.train(_cfg(b, warm, *LORA_REWARDS, ray_on=False))
    _same_as_local(a, b)
    rows = [r for r in _metrics(a) if "train/loss" in r]
    assert all(r["reward/length_mean"] > 0 for r in rows)
    assert all(r["reward/constant_mean"] == pytest.approx(0.2) for r in rows)  # sandboxed
    assert (a / "final" / "adapter_model.safetensors").is_file()  # the adapter, synced as such
    assert s["runner"] == "ray" and s["recovery/rollout_restarts"] == 0


@pytest.mark.slow  # 10-15 s; the feature's local run is in the default suite
def test_gae_critic_under_ray_matches_local(ray_cluster, warm, tmp_path):
    a, b = tmp_path / "ray", tmp_path / "local"
    extra = ["train.algo.advantage=gae", "train.algo.value_model=critic"]
    runners.train(_cfg(a, warm, *extra))
    runners.train(_cfg(b, warm, *extra, ray_on=False))
    _same_as_local(a, b)
    assert all(r["train/value_loss"] > 0 for r in _metrics(a) if "train/loss" in r)


@pytest.mark.slow  # 10-15 s; the feature's local run is in the default suite
def test_dynamic_sampling_under_ray_trains_only_groups_with_variance(ray_cluster, warm, tmp_path):
    d = tmp_path / "run"
    runners.train(_cfg(d, warm, "train.dapo.dynamic_sampling=true", "train.dapo.max_rounds=4",
                       "ray.rollout_workers=2", "ray.tasks_per_share=2"))  # fmt: skip
    rows = [json.loads(x) for x in (d / "trajectories.jsonl").read_text().splitlines()]
    by_group: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        by_group.setdefault((r["status"], r["traj_id"].split(":")[0]), []).append(r["reward"])
    trained = [v for (status, _), v in by_group.items() if status == "trained"]
    steps = [r for r in _metrics(d) if "train/loss" in r]
    assert len(steps) == STEPS and trained
    kept_all = all(r["rollout/groups_kept"] == TASKS for r in steps)
    if kept_all:  # every trained group was filled with variance: none is uniform
        assert all(len(set(v)) > 1 for v in trained)
    dropped = [v for (status, _), v in by_group.items() if status == "dropped"]
    assert all(len(set(v)) == 1 for v in dropped), "only uniform groups are dropped"
    assert any(r["rollout/frac_groups_dropped"] > 0 for r in steps) == bool(dropped)


@pytest.mark.slow  # 13-20 s; the feature's local run is in the default suite
def test_http_engine_workers_follow_the_trainer(ray_cluster, warm, tmp_path):
    """Colocated with the server, which sleeps for each update and wakes before the weight load
    (the hand-over of one pool), while the trainer offloads its optimizer state."""
    import httpx

    server = start_server(warm, tmp_path)
    try:
        d = tmp_path / "run"
        extra = ["engine.kind=http", f"engine.urls=[{server.url}]", "engine.timeout_s=60",
                 "ray.rollout_workers=2", "ray.tasks_per_share=2", "train.steps=2",
                 "ray.placement=colocated", "ray.rollout.num_cpus=0.5", "ray.trainer.num_cpus=0.5",
                 "ray.handover.sleep_engines=true",
                 "ray.handover.offload_optimizer=true"]  # fmt: skip
        s = runners.train(_cfg(d, warm, *extra))
        steps = [r for r in _metrics(d) if "train/loss" in r]
        state = httpx.get(f"{server.url}/is_sleeping").json()
        assert state == {"is_sleeping": False, "sleeps": 2, "wakes": 2}
        for r in steps:
            assert r["handover/engine_sleep_s"] > 0 and r["handover/engine_wake_s"] > 0
            assert r["handover/optimizer_offload_bytes"] == 0  # a CPU trainer frees no device
            assert "handover/trainer_offload_s" in r and "handover/trainer_load_s" in r
        assert [r["policy_version"] for r in steps] == [1.0, 2.0]
        versions = sorted(p.name for p in (d / "sync").iterdir())
        assert versions[-1] == "v2"  # the trainer pushed its weights to the server every step
        rows = [json.loads(x) for x in (d / "trajectories.jsonl").read_text().splitlines()]
        assert {r["policy_version"] for r in rows if r["step"] == 2} == {1}  # sampled from v1
        assert s["after"]["eval/success_greedy"] >= 0.0
    finally:
        server.stop()


def test_default_placement_fits_two_cpus_and_fault_limits_stop_ray(
    ray_cluster, warm, tmp_path, monkeypatch
):
    """No ray.* resources set: 2 workers + 1 trainer need 3 CPUs; the run fits itself. Every env
    step raising (fault injection, inherited by the actors) makes every episode fail: the
    ``faults.max_failed_fraction`` limit stops the Ray run at the same step, with the same
    message, as the local one."""
    monkeypatch.setenv("GYRE_FAULT", "env.step:raise")
    for ray_on in (True, False):
        d = tmp_path / ("ray" if ray_on else "local")
        cfg = load_config(None, [*TINY, f"run.dir={d}", f"model.path={warm}", "sft.steps=0",
                                 "train.steps=4", f"train.tasks_per_step={TASKS}",
                                 f"train.group_size={GROUP}", "checkpoint.every=0",
                                 "eval.episodes=0", "faults.max_failed_fraction=0.5"]
                          + (["runner=ray"] if ray_on else []))  # fmt: skip
        with pytest.raises(FaultAbort, match=r"GRPO step 1: 16 of 16 episodes failed in the env"):
            runners.train(cfg)
        if ray_on:
            saved = (d / "config.yaml").read_text()
            assert "placement: colocated" in saved  # fitted, and recorded
        rows = [r for r in _metrics(d) if "train/loss" in r]
        assert [r["step"] for r in rows] == [1] and rows[0]["rollout/failed_episodes"] == 16


@pytest.mark.slow  # 13-20 s; the feature's local run is in the default suite
def test_nonfinite_parameters_stop_a_ray_run_like_a_local_one(ray_cluster, warm, tmp_path):
    """A learning rate that overflows the weights (train.lr=inf, which the config refuses, so it
    is set behind its back) makes the first optimizer step write nan/inf into them: the parameter
    check after the update (inside the Ray trainer actor) stops the Ray run at the same step as
    the local one, with nothing logged or saved for that step."""
    bad = ["faults.max_nonfinite_streak=2", "eval.episodes=0"]
    for ray_on in (True, False):
        d = tmp_path / ("ray" if ray_on else "local")
        cfg = load_config(None, [*TINY, f"run.dir={d}", f"model.path={warm}", "sft.steps=0",
                                 "train.steps=6", f"train.tasks_per_step={TASKS}",
                                 f"train.group_size={GROUP}", "checkpoint.every=0", *bad]
                          + (["runner=ray"] if ray_on else []))  # fmt: skip
        cfg.train = cfg.train.model_copy(update={"lr": float("inf")})
        with pytest.raises(FaultAbort, match="GRPO step 1: after the optimizer step parameter"):
            runners.train(cfg)
        steps = [r["step"] for r in _metrics(d) if "train/loss" in r]
        assert steps == []
        assert not (d / "final").exists()


VLM = [
    "run.threads=1", "log.console=off", "sft.steps=0", "train.steps=2", "train.tasks_per_step=2",
    "train.group_size=4", "train.lr=0.05", "train.mini_batches=1", "train.kl_coef=0",
    "train.sampling.max_new_tokens=6", "eval.episodes=2", "checkpoint.every=0",
    "env.name=vision_helpers:ColourEnv", "env.kwargs.turns=2", "model.kind=qwen2_5_vl",
]  # fmt: skip


@pytest.mark.slow  # 10-15 s; the feature's local run is in the default suite
def test_vlm_with_image_turns_under_ray_matches_local(ray_cluster, tmp_path):
    """A tiny Qwen2.5-VL on a multi-turn image env: the rollout workers get the images from the
    env, the trajectories carry them to the trainer rank, and metrics and weights are bitwise
    those of the local runner (vision tower frozen in both)."""
    a, b = tmp_path / "ray", tmp_path / "local"
    s = runners.train(
        load_config(None, [*VLM, f"run.dir={a}", "runner=ray", "ray.tasks_per_share=2"])
    )
    runners.train(load_config(None, [*VLM, f"run.dir={b}"]))
    _same_as_local(a, b)
    steps = [r for r in _metrics(a) if "train/loss" in r]
    assert all(r["train/rollout_logprob_gap"] < 1e-4 for r in steps)  # same pixels, same ids
    assert s["runner"] == "ray"


def _record_episodes(model_dir: Path, out: Path, temperature: float, groups: int) -> None:
    """A recording in the ``gyre serve --record`` schema: the warm model's own samples on
    arithmetic tasks (real ids and log-probs), GROUP attempts per task, scored by the env."""
    from gyre.engines import TorchEngine
    from gyre.envs.arithmetic import ArithmeticEnv
    from gyre.models.build import load_pretrained
    from gyre.rollout.recorded import RECORD_FILE, RECORD_SCHEMA
    from gyre.rollout.stops import derive_stops
    from gyre.types import GenerationRequest, SamplingParams

    model, tok = load_pretrained(model_dir, torch.device("cpu"))
    engine, stops = TorchEngine(model, tok.pad_token_id, seed=0), derive_stops(tok)
    params = SamplingParams(temperature, 1.0, 3, stops.token_ids, seed=5)
    out.mkdir(parents=True)
    with open(out / RECORD_FILE, "w") as fh:
        for task in range(groups):
            env = ArithmeticEnv(3, "+")
            prompt = tok.encode(env.reset(1000 + task), add_special_tokens=False)
            done = engine.generate([GenerationRequest(prompt)] * GROUP, params)
            for j, c in enumerate(done):
                env.reset(1000 + task)
                _, reward, _, _ = env.step(tok.decode(c.token_ids, skip_special_tokens=True))
                seg = {"token_ids": prompt + list(c.token_ids),
                       "loss_mask": [0] * len(prompt) + [1] * len(c.token_ids),
                       "rollout_logprobs": [0.0] * len(prompt) + list(c.logprobs)}  # fmt: skip
                rec = {"schema": RECORD_SCHEMA, "session": f"t{task}-{j}", "group": f"t{task}",
                       "reward": reward, "temperature": temperature, "top_p": 1.0,
                       "num_calls": 1, "segments": [seg]}  # fmt: skip
                fh.write(json.dumps(rec) + "\n")


@pytest.mark.slow  # 10-15 s; the feature's local run is in the default suite
def test_recorded_source_under_ray_matches_local(ray_cluster, warm, tmp_path):
    """``train.source=DIR`` with ``runner=ray``: the rollout workers serve the recording's
    groups instead of playing the env, and metrics and weights are bitwise the local run's."""
    rec = tmp_path / "rec"
    temperature = load_config(None, TINY).train.sampling.temperature
    _record_episodes(warm, rec, temperature, groups=STEPS * TASKS)
    a, b = tmp_path / "ray", tmp_path / "local"
    s = runners.train(_cfg(a, warm, f"train.source={rec}", "train.algo.skip_zero_advantage=false"))
    runners.train(
        _cfg(b, warm, f"train.source={rec}", "train.algo.skip_zero_advantage=false", ray_on=False)
    )
    _same_as_local(a, b)
    steps = [r for r in _metrics(a) if "train/loss" in r]
    assert len(steps) == STEPS and s["runner"] == "ray"
    assert all(0 < r["train/is_weight"] <= 2.0 for r in steps)  # rollout IS on under a source


def test_memoryless_maze_with_gigpo_under_ray_matches_local(ray_cluster, tmp_path):
    """rollout.history_turns=0 (each turn a row, GiGPO's turn credit per row) composes with the
    Ray runner through the one loop: bitwise the local run's metrics and weights."""
    maze = [t for t in TINY if not t.startswith(("env.", "train.sampling"))] + [
        "env.name=maze", "rollout.history_turns=0", "rollout.keep_opening=false",
        "train.algo.advantage=gigpo", "train.sampling.max_new_tokens=2", "sft.steps=60",
        "sft.demos=256", "sft.batch_size=16", "sft.lr=0.01",
        f"train.steps={STEPS}", f"train.tasks_per_step={TASKS}", f"train.group_size={GROUP}",
        "train.lr=0.01", "train.sampling.temperature=1.0", "eval.episodes=8",
        "checkpoint.every=0", "train.level_replay.prob=0",
    ]  # fmt: skip
    a, b = tmp_path / "ray", tmp_path / "local"
    runners.train(load_config(None, [*maze, f"run.dir={a}", "runner=ray",
                                     f"ray.tasks_per_share={TASKS}"]))  # fmt: skip
    runners.train(load_config(None, [*maze, f"run.dir={b}"]))
    _same_as_local(a, b)
    samples = [json.loads(x) for x in (b / "samples.jsonl").read_text().splitlines()]
    assert samples, "the run wrote samples"
