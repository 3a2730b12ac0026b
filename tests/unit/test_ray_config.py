"""The runner choice and the ray section: validation, placement bundles, no Ray in the loop."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gyre.config import ConfigError, load_config


def test_runner_defaults_to_local_and_ray_errors_name_the_fields():
    assert load_config().runner == "local"
    with pytest.raises(ConfigError, match=r"ray.mode='one-step-off' needs ray.placement"):
        load_config(None, ["runner=ray", "ray.placement=colocated", "ray.mode=one-step-off"])
    with pytest.raises(ConfigError, match=r"ray.tasks_per_share=3 must divide"):
        load_config(None, ["runner=ray", "ray.tasks_per_share=3"])
    with pytest.raises(ConfigError, match=r"ray.trainer_ranks=3 must divide"):
        load_config(None, ["runner=ray", "ray.trainer_ranks=3"])
    with pytest.raises(ConfigError, match=r"needs ray.trainer_ranks=1"):
        load_config(
            None, ["runner=ray", "train.algo.advantage=reinforce_pp", "ray.trainer_ranks=2"]
        )
    with pytest.raises(ConfigError, match=r"weight_sync=shared .* separate actors"):
        load_config(None, ["runner=ray", "engine.weight_sync=shared"])
    # the former refusals are features now (tests/integration/test_ray_features.py)
    for ok in (["train.algo.advantage=gae"], ["model.lora={rank: 4}"],
               ["engine.kind=http", "engine.urls=[http://h:1]"],
               ["train.dapo.dynamic_sampling=true"],
               ["reward.functions=[{fn: 'reward_fixtures:length'}]"]):  # fmt: skip
        assert load_config(None, ["runner=ray", *ok]).runner == "ray"
    with pytest.raises(ConfigError, match=r"'ray.mode'"):
        load_config(None, ["ray.mode=sometimes"])
    with pytest.raises(ConfigError, match=r"'runner'"):
        load_config(None, ["runner=slurm"])


def test_loop_and_algorithms_do_not_import_ray():
    code = (
        "import sys, gyre.loop, gyre.trainer, gyre.rollout, gyre.algos, gyre.runners,"
        " gyre.runners.scheduler, gyre.runners.actors, gyre.runners.local, gyre.runners.placement,"
        " gyre.trainer.distributed; "
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_placement_bundles_colocated_and_disaggregated():
    pytest.importorskip("ray")
    from gyre.runners.ray import placement_bundles

    base = ["runner=ray", "ray.rollout_workers=2", "ray.trainer_ranks=2",
            "ray.rollout.num_gpus=0.5", "ray.trainer.num_gpus=0.5", "ray.rollout.num_cpus=1",
            "ray.trainer.num_cpus=2"]  # fmt: skip
    bundles, rb, tb = placement_bundles(load_config(None, [*base, "ray.placement=colocated"]))
    assert bundles == [{"CPU": 3.0, "GPU": 1.0}] * 2 and rb == [0, 1] and tb == [0, 1]
    bundles, rb, tb = placement_bundles(load_config(None, base))
    assert bundles == [{"CPU": 1.0, "GPU": 0.5}] * 2 + [{"CPU": 2.0, "GPU": 0.5}] * 2
    assert rb == [0, 1] and tb == [2, 3]
    with pytest.raises(ValueError, match=r"ray\.rollout reserves nothing"):
        placement_bundles(load_config(None, ["runner=ray", "ray.rollout.num_cpus=0"]))


def test_runner_ray_without_ray_names_the_extra(monkeypatch, tmp_path):
    from gyre import runners

    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    cfg = load_config(None, ["runner=ray", f"run.dir={tmp_path}", "sft.steps=0"])
    with pytest.raises(ImportError, match=r"pip install 'gyre\[ray\]'"):
        runners.train(cfg)


def test_async_runs_get_the_off_policy_correction_by_default():
    from gyre.config import load_config
    from gyre.runners.ray import off_policy_default

    base = ["runner=ray"]
    for mode, extra, want in (
        ("async", [], "truncate"),
        ("one-step-off", [], "truncate"),
        ("async", ["ray.max_staleness=0"], "none"),  # nothing can be stale
        ("sync", [], "none"),
        ("async", ["train.algo.rollout_is=none"], "none"),  # the config's own choice stays
        ("one-step-off", ["train.algo.rollout_is=mask"], "mask"),
    ):
        cfg = load_config(None, [*base, f"ray.mode={mode}", *extra])
        changed = off_policy_default(cfg)
        assert cfg.train.algo.rollout_is == want, (mode, extra)
        assert changed == (want == "truncate")


def test_default_placement_fits_the_cluster_and_says_so():
    from gyre.runners.placement import bundles_cpus, fit_placement, placement_bundles

    cfg = load_config(None, ["runner=ray"])  # 2 workers + 1 trainer, 1 CPU each: 3 CPUs
    assert fit_placement(cfg, 8.0) is None and cfg.ray.placement == "disaggregated"
    note = fit_placement(cfg, 2.0)
    assert cfg.ray.placement == "colocated" and bundles_cpus(placement_bundles(cfg)[0]) <= 2.0
    assert "does not fit the cluster's 2 CPUs" in note and "ray.placement=colocated" in note
    cfg = load_config(None, ["runner=ray", "ray.mode=one-step-off"])  # cannot colocate: scaled
    fit_placement(cfg, 2.0)
    assert cfg.ray.placement == "disaggregated"
    assert bundles_cpus(placement_bundles(cfg)[0]) <= 2.0 and cfg.ray.rollout.num_cpus < 1


def test_explicit_placement_that_cannot_fit_is_a_one_line_error():
    from gyre.runners.placement import fit_placement

    cfg = load_config(None, ["runner=ray", "ray.placement=disaggregated"])
    with pytest.raises(ValueError, match=r"needs 3 CPUs .*ray.placement.*the cluster has 2"):
        fit_placement(cfg, 2.0)
    cfg = load_config(None, ["runner=ray", "ray.trainer.num_cpus=2"])
    with pytest.raises(ValueError, match=r"ray.trainer"):
        fit_placement(cfg, 2.0)
