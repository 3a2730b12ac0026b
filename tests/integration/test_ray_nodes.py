"""Several Ray nodes on this machine (``ray.cluster_utils.Cluster``): a head that runs nothing,
two rollout nodes and two trainer nodes, each with a custom resource that pins its role.

Every test here starts Ray worker processes on several raylets (tens of seconds on two cores),
so all are marked slow; run them with ``GYRE_SLOW=1``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from gyre import loop, runners, sft  # noqa: E402
from gyre.config import load_config  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("GYRE_SLOW") != "1", reason="slow: set GYRE_SLOW=1"),
]

TASKS, GROUP = 4, 4
PERIOD_S, FAILURES = 0.5, 4  # the node-lost deadline of these clusters: 2 x 0.5 x 4 = 4 s
DEADLINE_S = 2 * PERIOD_S * FAILURES
ROLLOUT = {"gyre_rollout": 2.0}
TRAINER = {"gyre_trainer": 1.0}
TINY = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.intermediate_size=64",
    "sft.batch_size=16",
    "sft.lr=0.01",
    "log.console=off",
    "run.threads=1",
]


class Nodes:
    """A head (no CPUs: the driver only) and worker nodes, which tests remove and re-add."""

    def __init__(self, tmp: Path) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "include_dashboard": False,
                "temp_dir": str(tmp),
                "_system_config": {  # what gyre.runners.nodes.health_system_config sets
                    "health_check_period_ms": int(PERIOD_S * 1000),
                    "health_check_timeout_ms": int(PERIOD_S * 1000),
                    "health_check_failure_threshold": FAILURES,
                },
            },
        )
        self.roles: dict[str, dict] = {}  # node id -> its resources
        for res in (ROLLOUT, ROLLOUT, TRAINER, TRAINER):
            self.add(res)

    def add(self, resources: dict) -> str:
        node = self.cluster.add_node(num_cpus=1, resources=resources)
        self.roles[node.node_id] = resources
        self.cluster.wait_for_nodes()
        return node.node_id

    def remove(self, node_id: str) -> dict:
        node = next(n for n in self.cluster.worker_nodes if n.node_id == node_id)
        self.cluster.remove_node(node, allow_graceful=False)  # kill -9 of its raylet
        return self.roles.pop(node_id)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import shutil
    import tempfile

    # Unix socket paths are capped at 107 bytes: a short session dir, not pytest's tmp path
    short = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))
    n = Nodes(short)
    ray.init(address=n.cluster.address, namespace="gyre", log_to_driver=False)
    yield n
    ray.shutdown()
    n.cluster.shutdown()
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("warm")
    cfg = load_config(None, [*TINY, f"run.dir={d}", "sft.steps=40", "sft.demos=128"])
    run_dir, _ = loop.setup(cfg)
    return sft.run_sft(cfg, run_dir, torch_cpu(), loop.base_model_path(cfg, run_dir))


def torch_cpu():
    import torch

    return torch.device("cpu")


def _overrides(run_dir: Path, model: Path, steps: int, *extra: str) -> list[str]:
    return [
        *TINY,
        f"run.dir={run_dir}",
        f"model.path={model}",
        "sft.steps=0",
        f"train.steps={steps}",
        f"train.tasks_per_step={TASKS}",
        f"train.group_size={GROUP}",
        "train.mini_batches=2",
        "train.lr=0.003",
        "eval.episodes=0",
        "train.level_replay.prob=0",
        "runner=ray",
        "ray.rollout_workers=2",
        "ray.rollout.num_cpus=0.5",
        "ray.trainer.num_cpus=0.5",
        "ray.rollout.resources={gyre_rollout: 1}",
        "ray.trainer.resources={gyre_trainer: 1}",
        f"ray.health_check_period_s={PERIOD_S}",
        f"ray.health_check_failures={FAILURES}",
        *extra,
    ]


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _trained_ids(run_dir: Path) -> list[str]:
    return [r["traj_id"] for r in _rows(run_dir / "trajectories.jsonl") if r["status"] == "trained"]


def _expected_ids(steps: int) -> list[str]:
    return [f"{task}:{j}" for task in range(steps * TASKS) for j in range(GROUP)]


def _node_of(actor_name: str) -> str:
    actor = ray.get_actor(actor_name, namespace="gyre")
    return ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))


def test_roles_pinned_and_two_ranks_on_two_nodes_match_one_rank(nodes, warm_model, tmp_path):
    """Rollout workers land on rollout nodes, the two trainer ranks on the two trainer nodes
    (gloo across raylets). Within a tolerance, not bitwise: the two ranks' gradients are summed
    by an all-reduce, whose float order differs from one rank's sum over the whole batch; the
    loss and gradient norm agree to 1e-5 (relative) and the weights after 3 steps to 1e-5
    (measured: 0 to 1e-7)."""
    from safetensors.torch import load_file

    from gyre.runners.placement import actor_prefix

    seen: dict[str, str] = {}

    class Where:
        def log(self, step: int, metrics: dict) -> None:
            if step == 1 and not seen:
                for name in ("rollout-0", "rollout-1", "trainer-0-e1", "trainer-1-e1"):
                    seen[name] = _node_of(f"{actor_prefix(cfg)}-{name}")

        def message(self, text: str) -> None: ...

        def close(self) -> None: ...

    # one share per step: the same rollouts; one optimizer step per batch: with several, each
    # rank would cut its own shard into mini-batches, which groups other rows together
    steps, share = 3, f"ray.tasks_per_share={TASKS}"
    share = [share, "train.mini_batches=1"]
    two, one = tmp_path / "two", tmp_path / "one"
    cfg = load_config(None, _overrides(two, warm_model, steps, *share, "ray.trainer_ranks=2"))
    cfg.run.dir = str(two.resolve())
    runners.train(cfg, Where())
    runners.train(load_config(None, _overrides(one, warm_model, steps, *share)))
    assert {nodes.roles[seen[f"rollout-{i}"]] == ROLLOUT for i in (0, 1)} == {True}
    t0, t1 = seen["trainer-0-e1"], seen["trainer-1-e1"]
    assert t0 != t1 and nodes.roles[t0] == nodes.roles[t1] == TRAINER
    a = load_file(str(two / "final" / "model.safetensors"))
    b = load_file(str(one / "final" / "model.safetensors"))
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    moved = max((a[k] - load_file(str(warm_model / "model.safetensors"))[k]).abs().max().item()
                for k in a)  # fmt: skip
    for ra, rb in zip(_rows(two / "metrics.jsonl"), _rows(one / "metrics.jsonl"), strict=True):
        assert ra["rollout/reward_mean"] == rb["rollout/reward_mean"]  # the same rollouts
        for k in ("train/loss", "train/grad_norm"):
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-7), (ra["step"], k)
    assert moved > 1e-3
    assert diff <= 1e-5, diff
    print(f"two ranks on two nodes vs one rank: max |w2 - w1| = {diff:.2e}")
    assert sorted(_trained_ids(two)) == sorted(_trained_ids(one)) == sorted(_expected_ids(steps))


def _lose_a_node(nodes: Nodes, proc: subprocess.Popen, run_dir: Path, victim: str) -> tuple:
    """Once step 1 is logged, let step 2 start, remove the node that holds ``victim`` (kill -9 of
    its raylet), time until Ray declares it dead, then have a replacement node with the same
    resources join (from this thread: Ray's node start-up needs the main thread)."""
    deadline = time.time() + 900  # actor start-up on loaded cores
    while not any(
        r.get("step") == 1 and "train/loss" in r for r in _rows(run_dir / "metrics.jsonl")
    ):
        assert proc.poll() is None and time.time() < deadline, "step 1 never logged"
        time.sleep(0.05)
    time.sleep(0.3)  # inside the next step: shares in flight / the update running
    node = _node_of(victim)
    t0 = time.time()
    res = nodes.remove(node)
    while any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node):
        time.sleep(0.05)
    seconds = time.time() - t0
    time.sleep(1.0)
    nodes.add(res)
    return node, seconds


@pytest.mark.parametrize("mode", ["sync", "one-step-off"])
@pytest.mark.parametrize("role", ["rollout", "trainer"])
def test_a_node_lost_mid_step_loses_nothing(nodes, warm_model, tmp_path, role, mode):
    """``gyre train`` (its own process, joined to the cluster) loses a node in step 2: a rollout
    node (its shares are reissued on the nodes left) or a trainer node (the group is rebuilt from
    the newest checkpoint on a node that has room). Every planned trajectory trains exactly once,
    the run exits 0, and ``recovery/*`` counts the loss."""
    from gyre.runners.placement import actor_prefix

    steps, run_dir = 6, tmp_path / "run"
    ov = _overrides(run_dir, warm_model, steps, f"ray.mode={mode}", "checkpoint.every=1",
                    f"ray.address={nodes.cluster.address}", "ray.namespace=gyre",
                    "log.console=plain")  # fmt: skip
    cfg = load_config(None, ov)
    cfg.run.dir = str(run_dir.resolve())
    victim = f"{actor_prefix(cfg)}-{'rollout-0' if role == 'rollout' else 'trainer-0-e1'}"
    proc = _train(ov)
    try:
        node, seconds = _lose_a_node(nodes, proc, run_dir, victim)
        out = proc.communicate(timeout=600)[0]
    except AssertionError as exc:
        if proc.poll() is None:
            proc.kill()
        raise AssertionError(f"{exc}\n{proc.communicate()[0][-3000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    print(f"{role}/{mode}: node declared dead {seconds:.2f} s after its raylet was killed")
    assert seconds <= DEADLINE_S + 1.0
    assert f"(id {node[:8]};" in out and "lost: declared dead" in out, out[-3000:]
    last = [r for r in _rows(run_dir / "metrics.jsonl") if "train/loss" in r][-1]
    assert last["step"] == steps
    assert last["recovery/lost_nodes"] >= 1
    assert last[f"recovery/{role}_restarts"] >= 1
    ids = _trained_ids(run_dir)
    assert len(ids) == len(set(ids)), "a trajectory was trained twice"
    assert sorted(ids) == sorted(_expected_ids(steps)), "a trajectory was lost"


def test_a_node_that_stops_answering_is_declared_lost_in_time(nodes):
    """SIGSTOP a node's raylet (it neither dies nor answers): Ray's health check, with the
    period, timeout and failure count gyre sets, declares it dead in about 2 x period x failures
    (4 s here). The bound asserted is 3 x that: on two shared cores the GCS's own timers run
    late (measured 4-9 s at load averages of 10-20). With Ray's default 10 s check timeout the
    same stop took 46 s: the deadline is set, not left to Ray's defaults."""
    extra = nodes.add({"gyre_spare": 1.0})
    node = next(n for n in nodes.cluster.worker_nodes if n.node_id == extra)
    pid = node.all_processes["raylet"][0].process.pid
    os.kill(pid, signal.SIGSTOP)
    t0 = time.time()
    try:
        while any(n["Alive"] for n in ray.nodes() if n["NodeID"] == extra):
            assert time.time() - t0 < 60, "never declared dead"
            time.sleep(0.05)
        took = time.time() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    print(f"a stopped raylet was declared dead after {took:.2f} s")
    assert took <= 3 * DEADLINE_S
    nodes.remove(extra)


def _train(ov: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "gyre.cli", "train", *ov]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw
    )


def _finish(p: subprocess.Popen, timeout: float = 900) -> str:
    """The run's output once it ends with exit 0; its tail in the failure otherwise."""
    try:
        out = p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        p.kill()
        tail = p.communicate()[0][-3000:]
        raise AssertionError(f"still running after {timeout:g} s:\n{tail}") from None
    assert p.returncode == 0, out[-3000:]
    return out


def test_fsdp2_on_two_nodes_checkpoints_the_whole_model_and_resumes(nodes, warm_model, tmp_path):
    """``ray.strategy=fsdp2``, two CPU ranks (gloo) on the two trainer nodes. Each checkpoint
    holds the whole model (every tensor at full shape, equal to the gathered final weights for
    the last one). The driver killed with SIGKILL after a checkpoint and resumed: final weights
    bitwise equal to the run that was never killed. The same checkpoint resumed with one rank
    runs to the end, within 1e-5 of two ranks (another all-reduce order). The maze's turns give
    the two ranks different numbers of rows, hence of micro-batches: the update pads them to the
    same count (gyre.trainer.lockstep), where they would otherwise deadlock."""
    import shutil

    from safetensors.torch import load_file

    steps = 4
    # small micro-batches: the ranks' unequal row counts give them unequal micro-batch counts
    fsdp = ["ray.strategy=fsdp2", "ray.trainer_ranks=2", "checkpoint.every=1", "checkpoint.keep=10",
            "train.mini_batches=1", "train.micro_batch_size=4",
            f"ray.address={nodes.cluster.address}"]  # fmt: skip
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    _finish(_train(_overrides(whole, warm_model, steps, *fsdp)))
    warm = load_file(str(warm_model / "model.safetensors"))
    final = load_file(str(whole / "final" / "model.safetensors"))
    last_dir = whole / "checkpoints" / f"step_{steps:06d}" / "model"
    last = load_file(str(last_dir / "model.safetensors"))
    assert set(last) == set(warm) and all(last[k].shape == warm[k].shape for k in warm)
    assert all(torch_equal(last[k], final[k]) for k in final)

    p = _train(_overrides(killed, warm_model, steps, *fsdp))
    ckpts = killed / "checkpoints"
    deadline = time.time() + 900
    while not (ckpts / "step_000002").is_dir():
        assert p.poll() is None and time.time() < deadline, "no checkpoint of step 2"
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    fewer = tmp_path / "one-rank"
    shutil.copytree(killed, fewer)
    _finish(_train(_overrides(killed, warm_model, steps, *fsdp, "run.resume=auto")))
    resumed = load_file(str(killed / "final" / "model.safetensors"))
    assert all(torch_equal(resumed[k], final[k]) for k in final), "resume is not bit-exact"
    assert sorted(_trained_ids(killed)) == sorted(_expected_ids(steps))

    one = [x.replace("ray.trainer_ranks=2", "ray.trainer_ranks=1") for x in fsdp]
    _finish(_train(_overrides(fewer, warm_model, steps, *one, "run.resume=auto")))
    alone = load_file(str(fewer / "final" / "model.safetensors"))
    for k in final:
        torch_close(alone[k], final[k])
    assert sorted(_trained_ids(fewer)) == sorted(_expected_ids(steps))


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def torch_close(a, b) -> None:
    import torch

    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
