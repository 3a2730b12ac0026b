"""``gyre tinker-serve runner=ray`` with the official ``tinker`` SDK, unmodified: the trainer
and two samplers as Ray actors on a cluster of three nodes on this machine (a head that runs
nothing, a node with the ``tinker_trainer`` resource and one with ``tinker_sampler``), checked
against the one-process server.

Every test here starts Ray raylets and actor processes (tens of seconds on two cores), so all
are marked slow; run them with ``GYRE_SLOW=1``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
ray = pytest.importorskip("ray")
from tinker import types  # noqa: E402

from tinker_helpers import sl_data, start_in_process  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("GYRE_SLOW") != "1", reason="slow: set GYRE_SLOW=1"),
]

KEY = "tml-local-test"
ROLES = {
    "runner": "ray",
    "ray": {
        "sampler_workers": 2,
        "trainer": {"resources": {"tinker_trainer": 1}},
        "sampler": {"resources": {"tinker_sampler": 1}},
        "startup_timeout_s": 300,
        "call_timeout_s": 300,
    },
}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Unix socket paths are capped at 107 bytes: a short session dir, not pytest's tmp path
    short = Path(tempfile.mkdtemp(prefix="tr", dir="/tmp"))
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "temp_dir": str(short)},
    )
    nodes = {
        "trainer": c.add_node(num_cpus=1, resources={"tinker_trainer": 1}).node_id,
        "sampler": c.add_node(num_cpus=2, resources={"tinker_sampler": 2}).node_id,
    }
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="gyre-tinker-tests", log_to_driver=False)
    yield nodes
    ray.shutdown()
    c.shutdown()
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture(scope="module")
def on_ray(cluster, tmp_path_factory):
    served = start_in_process(tmp_path_factory.mktemp("ray-state"), **ROLES)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    served = start_in_process(tmp_path_factory.mktemp("local-state"))
    yield served
    served.stop()


def _client(served):
    return tinker.ServiceClient(base_url=served.url, api_key=KEY)


def _base(client) -> str:
    return client.get_server_capabilities().supported_models[0].model_name


def _steps(tc, data, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def _ask(sampler, tok, seed: int, n: int = 4, max_tokens: int = 4):
    prompt = types.ModelInput.from_ints(tok.encode("2+2=", add_special_tokens=False))
    stop = [] if max_tokens > 4 else None  # long draws run to max_tokens
    params = types.SamplingParams(max_tokens=max_tokens, seed=seed, stop=stop)
    return sampler.sample(prompt, n, params, include_prompt_logprobs=True)


def _draw(sampler, tok, seed: int, n: int = 4, max_tokens: int = 4):
    res = _ask(sampler, tok, seed, n, max_tokens).result()
    return [s.tokens for s in res.sequences], [s.logprobs for s in res.sequences], res


def test_roles_run_in_their_own_actors_on_their_nodes(on_ray, cluster):
    backend = on_ray.service.backend
    trainer = ray.get(backend.train.actor.where.remote())
    samplers = [ray.get(a.where.remote()) for a in backend.sample.actors]
    assert trainer["node_id"] == cluster["trainer"]
    assert [s["node_id"] for s in samplers] == [cluster["sampler"]] * 2
    pids = {trainer["pid"], *(s["pid"] for s in samplers)}
    assert len(pids) == 3 and os.getpid() not in pids


def test_sl_loop_and_sampling_match_the_one_process_server(on_ray, in_process):
    got = {}
    for name, served in (("ray", on_ray), ("local", in_process)):
        sc = _client(served)
        tc = sc.create_lora_training_client(base_model=_base(sc), rank=8, seed=1).result()
        tok = tc.get_tokenizer()
        losses = _steps(tc, sl_data(tok), 6)
        trained = _draw(tc.save_weights_and_get_sampling_client().result(), tok, seed=11)
        base = _draw(sc.create_sampling_client(base_model=_base(sc)), tok, seed=11)
        got[name] = losses, trained[:2], trained[2].prompt_logprobs, base[2].prompt_logprobs
        sc.close("success").result()
    losses, _, trained_lp, base_lp = got["ray"]
    assert losses[-1] < 0.5 * losses[0], losses
    assert not np.allclose(trained_lp[1:], base_lp[1:])  # the sampler runs the trained adapter
    # the same numbers as in one process: losses, samples, sampled and prompt logprobs
    assert got["ray"] == got["local"]


def test_trainer_actor_killed_mid_call_then_load_state_continues_exactly(on_ray):
    sc = _client(on_ray)
    tc = sc.create_lora_training_client(base_model=_base(sc), rank=4, seed=3).result()
    other = sc.create_lora_training_client(base_model=_base(sc), rank=4, seed=4).result()
    data = sl_data(tc.get_tokenizer())
    _steps(tc, data, 2)
    path = tc.save_state("before-kill").result().path
    tail = _steps(tc, data, 2)  # what an uninterrupted run does next
    # ~30k tokens: seconds of work, so the kill lands while the call is queued or running
    long = tc.forward_backward(sl_data(tc.get_tokenizer(), reps=2000), "cross_entropy")
    time.sleep(0.5)
    ray.kill(on_ray.service.backend.train.actor, no_restart=False)
    with pytest.raises(tinker.RequestFailedError, match="trainer actor died") as died:
        long.result()
    assert "load_state" in str(died.value)
    # a model nobody reloaded is gone with the old actor, and the error says why
    with pytest.raises(tinker.RequestFailedError, match="trainer actor was replaced"):
        _steps(other, data, 1)
    tc.load_state_with_optimizer(path).result()  # the same client, on the new actor
    assert _steps(tc, data, 2) == tail
    again = sc.create_training_client_from_state_with_optimizer(path).result()
    assert _steps(again, data, 2) == tail
    sc.close("success").result()


def test_sampler_actor_killed_mid_batch_is_named_and_replaced(on_ray):
    sc = _client(on_ray)
    sampler = sc.create_sampling_client(base_model=_base(sc))
    tok = sc.create_lora_training_client(base_model=_base(sc), rank=4).result().get_tokenizer()
    pool = on_ray.service.backend.sample
    before = [ray.get(a.where.remote())["pid"] for a in pool.actors]
    reference = _draw(sampler, tok, seed=5, n=32, max_tokens=96)[:2]
    future = _ask(sampler, tok, seed=5, n=32, max_tokens=96)
    deadline = time.monotonic() + 30
    while not any(pool.busy) and time.monotonic() < deadline:
        time.sleep(0.002)
    victim = pool.busy.index(1)
    ray.kill(pool.actors[victim], no_restart=False)  # the batch is on its way or running
    res = future.result()  # sent again to the other actor: the same samples
    assert [s.tokens for s in res.sequences] == reference[0]
    # (to float rounding: a copy that has loaded an adapter runs the base through peft)
    for seq, want in zip(res.sequences, reference[1], strict=True):
        np.testing.assert_allclose(seq.logprobs, want, rtol=1e-5, atol=1e-5)
    assert any(f"sampler actor {victim} died" in line for line in pool.deaths), pool.deaths
    for seed in range(4):  # enough batches to reach the replaced actor again
        _draw(sampler, tok, seed=seed)
    after = [ray.get(a.where.remote())["pid"] for a in pool.actors]
    assert after[victim] != before[victim] and after[1 - victim] == before[1 - victim]
    # every sampler gone for good: the client gets one line naming a sampler actor
    for actor in pool.actors:
        ray.kill(actor, no_restart=True)
    with pytest.raises(tinker.RequestFailedError, match=r"sampler actor [01] died"):
        _draw(sampler, tok, seed=0)
    with pytest.raises(tinker.RequestFailedError, match=r"sampler actor [01] is dead .*restarts"):
        _draw(sampler, tok, seed=0)
    with pytest.raises(tinker.RequestFailedError, match="every sampler actor is dead"):
        _draw(sampler, tok, seed=0)
    sc.close("success").result()


def test_start_up_failures_are_one_line_naming_the_cause(cluster, tmp_path):
    import torch

    from gyre.cli import _error_line
    from gyre.tinker.config import TinkerServeConfig
    from gyre.tinker.server import build_service

    def start(**overrides):
        ray_keys = {"startup_timeout_s": 5, **overrides.pop("ray", {})}
        cfg = TinkerServeConfig(state_dir=str(tmp_path), runner="ray", ray=ray_keys, **overrides)
        with pytest.raises(Exception) as info:
            build_service(cfg)
        line, code = _error_line(info.value)  # what gyre tinker-serve prints, and exits with
        assert "\n" not in line
        return line, code

    unplaced, code = start(ray={"trainer": {"resources": {"nowhere": 1}}})
    assert code == 69 and "no answer from trainer actor" in unplaced
    assert "'nowhere': 1.0" in unplaced
    if not torch.cuda.is_available():
        # no CPUs reserved (the other tests' server holds the nodes' CPUs); it fails as soon
        # as the actor's start raises, well within the deadline
        zero = {"num_cpus": 0}
        keys = {"trainer": zero, "sampler": zero, "startup_timeout_s": 120}
        broken, code = start(device="cuda", ray=keys)
        assert code == 1 and broken.startswith("gyre: error: trainer actor died")
        assert "CUDA is not available" in broken
