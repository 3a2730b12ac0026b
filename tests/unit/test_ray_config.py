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
    with pytest.raises(ConfigError, match=r"ray\.rollout\.resources: 'gyre_rollout: 0'"):
        load_config(None, ["runner=ray", "ray.rollout.resources={gyre_rollout: 0}"])


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


def test_combine_ranks_weights_token_means_by_the_tokens_each_rank_scored():
    """Data-parallel ranks skip their own zero-advantage rows: a rank that skipped every row has
    no token means, and the others' are weighted by the tokens they scored, not by all tokens."""
    from gyre.runners.placement import combine_ranks

    r0 = {"train/loss": 0.0, "train/tokens": 100.0, "train/scored_tokens": 0.0,
          "train/skipped_rows": 8.0, "train/grad_norm": 0.5, "time/train_s": 1.0}  # fmt: skip
    r1 = {"train/loss": 0.25, "train/tokens": 100.0, "train/scored_tokens": 30.0,
          "train/skipped_rows": 5.0, "train/grad_norm": 0.5, "time/train_s": 2.0,
          "train/entropy": 1.5, "train/is_weight": 0.9}  # fmt: skip
    r2 = {**r1, "train/scored_tokens": 10.0, "train/entropy": 3.5, "train/is_weight": 1.1}
    out = combine_ranks([r0, r1, r2])
    assert out["train/entropy"] == (1.5 * 30 + 3.5 * 10) / 40  # 2.0, rank 0 not counted as 0
    assert out["train/is_weight"] == (0.9 * 30 + 1.1 * 10) / 40
    assert out["train/loss"] == 0.5 and out["train/skipped_rows"] == 18.0
    assert out["train/tokens"] == 300.0 and out["train/scored_tokens"] == 40.0
    assert out["train/grad_norm"] == 0.5 and out["time/train_s"] == 2.0
    # every rank skipped everything: no token mean at all
    assert "train/entropy" not in combine_ranks([r0, r0])
    # without skipping the means are weighted by all tokens, as before
    a = {"train/tokens": 10.0, "train/entropy": 1.0, "train/loss": 0.1}
    b = {"train/tokens": 30.0, "train/entropy": 2.0, "train/loss": 0.2}
    assert combine_ranks([a, b])["train/entropy"] == (10 * 1.0 + 30 * 2.0) / 40


def test_custom_resources_pin_roles_and_handover_needs_colocation():
    from gyre.runners.placement import placement_bundles

    pin = ["runner=ray", "ray.rollout_workers=1", "ray.trainer_ranks=1",
           "ray.rollout.resources={gyre_rollout: 1}",
           "ray.trainer.resources={gyre_trainer: 2}"]  # fmt: skip
    bundles, _, _ = placement_bundles(load_config(None, pin))
    assert bundles == [{"CPU": 1.0, "gyre_rollout": 1.0}, {"CPU": 1.0, "gyre_trainer": 2.0}]
    bundles, _, _ = placement_bundles(load_config(None, [*pin, "ray.placement=colocated"]))
    assert bundles == [{"CPU": 2.0, "gyre_rollout": 1.0, "gyre_trainer": 2.0}]
    with pytest.raises(ConfigError, match=r"^ray\.rollout\.resources: 'CPU: 1'"):
        load_config(None, ["ray.rollout.resources={CPU: 1}"])
    with pytest.raises(ConfigError, match=r"needs ray\.placement=colocated"):
        load_config(None, ["ray.handover.offload_optimizer=true"])
    with pytest.raises(
        ConfigError, match=r"offload_weights does not work with ray\.strategy=fsdp2"
    ):
        load_config(None, ["ray.placement=colocated", "ray.strategy=fsdp2",
                           "ray.handover.offload_weights=true"])  # fmt: skip
