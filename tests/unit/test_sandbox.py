"""The reward sandbox: a sleeping reward is killed at its wall-time limit (the programs it
starts: test_sandbox_containment.py), one that allocates too much is stopped, one that opens a
socket fails, a crash is contained, and past ``max_failure_frac`` the step stops with a clear
error."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from gyre.config import RewardConfig, SandboxConfig
from gyre.rewards import RewardBatch, Rewarder, RewardSandboxError, _confine
from gyre.rewards._worker import isolate_network_message
from gyre.rewards.sandbox import SandboxPool


def _netns_available() -> bool:
    code = (
        "import gyre.rewards._confine as c; "
        "raise SystemExit(c.unshare(c.CLONE_NEWUSER | c.CLONE_NEWNET) is not None)"
    )
    return subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


NETNS = _netns_available()
NETWORK = "deny" if NETNS else "allow"  # timeout/memory checks still run where netns is refused
needs_netns = pytest.mark.skipif(not NETNS, reason="user+network namespaces refused here")


def _sandbox(**kw) -> SandboxConfig:
    return SandboxConfig(**{"timeout_s": 2.0, "memory_mb": 512, "network": NETWORK, **kw})


def _req(fn: str, group: int = 0, **kwargs) -> dict:
    return {
        "fn": f"reward_fixtures:{fn}",
        "prompts": ["p"],
        "completions": ["c"],
        "columns": {"group_id": [group]},
        "kwargs": kwargs,
    }


@pytest.fixture
def pool():
    fns = ["reward_fixtures:" + f for f in ("sleeper", "hog", "dialer", "chatty", "crash")]
    p = SandboxPool(_sandbox(workers=2), fns)
    yield p
    p.close()


@pytest.fixture
def listener():
    """A TCP server on 127.0.0.1 (free port) in the test's own network namespace."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv.getsockname()[1]
    srv.close()


def test_sleeping_reward_is_killed_and_the_worker_replaced(pool):
    res = pool.map([_req("sleeper", seconds=600), _req("chatty")])
    assert res[0].kind == "timeout" and res[0].values is None
    assert "2s wall-time limit" in res[0].error
    assert res[1].ok and res[1].values == [0.5]
    assert [r.kind for r in pool.map([_req("chatty")] * 3)] == ["ok"] * 3  # pool recovered


def test_allocating_past_the_memory_limit_is_stopped(pool):
    res = pool.map([_req("hog", mb=2048), _req("hog", group=1, when="group0")])  # 2 GiB > 512 MiB
    assert res[0].kind == "memory" and "MemoryError" in res[0].error
    assert res[1].ok and res[1].values == [1.0]  # 16 MiB under the same limit is fine


@needs_netns
def test_opening_a_socket_fails_in_the_sandbox_but_not_outside(pool, listener):
    import reward_fixtures as fx

    assert fx.dialer(["p"], ["c"], [0], port=listener) == [1.0]  # reachable from the test
    res = pool.map([_req("dialer", port=listener)])
    assert res[0].kind == "exception"
    assert "Network is unreachable" in res[0].error or "OSError" in res[0].error


def test_a_crashing_worker_is_contained(pool):
    res = pool.map([_req("crash"), _req("chatty")])
    assert res[0].kind == "crash" and "status 3" in res[0].error
    assert res[1].ok


def test_missing_network_isolation_is_reported_not_ignored():
    def refuse(flags: int) -> int:
        return -1

    why = _confine.unshare(_confine.CLONE_NEWUSER | _confine.CLONE_NEWNET, refuse)
    assert why is not None and why.startswith("unshare(CLONE_NEWUSER|CLONE_NEWNET) failed")
    assert "reward.sandbox.network=allow" in isolate_network_message(why)


def test_bad_sandboxed_path_names_the_field():
    cfg = RewardConfig.model_validate(
        {
            "functions": [{"fn": "reward_fixtures:nope", "sandbox": True}],
            "sandbox": _sandbox().model_dump(),
        }
    )
    with pytest.raises(ValueError, match=r"reward\.functions\[0\]\.fn.*cannot load"):
        Rewarder(cfg)


def _rewarder(tmp_path, max_frac: float, **sandbox) -> Rewarder:
    cfg = RewardConfig.model_validate(
        {
            "functions": [
                {"fn": "reward_fixtures:sleeper", "sandbox": True, "kwargs": {"when": "group0"}},
                {"fn": "reward_fixtures:hog", "sandbox": True, "kwargs": {"when": "group0"}},
            ],
            "env_weight": 0.0,
            "sandbox": _sandbox(
                max_failure_frac=max_frac, failure_reward=-1.0, **sandbox
            ).model_dump(),
        }
    )
    return Rewarder(cfg, tmp_path / "failures.jsonl")


def _four() -> RewardBatch:
    return RewardBatch(["p"] * 4, ["c"] * 4, {"group_id": [0, 0, 1, 1], "env_reward": [0.0] * 4})


def test_failures_get_the_failure_reward_and_are_counted_and_logged(tmp_path, caplog):
    r = _rewarder(tmp_path, max_frac=0.5)
    try:
        totals, values, metrics = r.score_batch(_four())
    finally:
        r.close()
    assert values["sleeper"] == [-1.0, -1.0, 1.0, 1.0]
    assert values["hog"] == [-1.0, -1.0, 1.0, 1.0]
    assert totals == [-2.0, -2.0, 2.0, 2.0]
    assert metrics["reward/sandbox_calls"] == 8
    assert metrics["reward/sandbox_failures"] == 4
    assert metrics["reward/sandbox_timeout"] == 2 and metrics["reward/sandbox_memory"] == 2
    assert metrics["reward/sandbox_failure_frac"] == 0.5
    logged = [json.loads(line) for line in (tmp_path / "failures.jsonl").read_text().splitlines()]
    assert sorted(x["kind"] for x in logged) == ["memory", "memory", "timeout", "timeout"]
    assert any("MemoryError" in x["error"] and "Traceback" in x["error"] for x in logged)
    assert "sandboxed reward hog" in caplog.text and "MemoryError" in caplog.text


def test_too_many_failures_stop_with_a_clear_error(tmp_path):
    r = _rewarder(tmp_path, max_frac=0.4)
    try:
        with pytest.raises(RewardSandboxError) as err:
            r.score_batch(_four())
    finally:
        r.close()
    msg = str(err.value)
    assert "4/8 calls failed" in msg and "reward.sandbox.max_failure_frac=0.4" in msg
    assert str(tmp_path / "failures.jsonl") in msg


def test_async_rewards_and_stdin_and_environment(monkeypatch):
    monkeypatch.setenv("GYRE_TEST_SECRET", "hunter2")
    fns = ["reward_fixtures:async_double_env", "reward_fixtures:secret_len"]
    p = SandboxPool(_sandbox(workers=1), [*fns, "reward_fixtures:reads_stdin"])
    try:
        req = _req("async_double_env")
        req["columns"]["env_reward"] = [0.25]
        res = p.map([req, _req("secret_len"), _req("reads_stdin"), _req("secret_len")])
    finally:
        p.close()
    assert [r.values for r in res] == [[0.5], [0.0], [0.0], [0.0]]  # awaited; no secret; no stdin
    import reward_fixtures as fx

    assert fx.secret_len(["p"], ["c"]) == [7.0]  # the variable is set in the parent


def test_refused_namespaces_stop_the_sandbox_loudly(monkeypatch):
    """A worker whose unshare() is refused: building the rewarder fails and names the field."""
    from gyre.rewards import SandboxUnavailableError, sandbox

    refuse = (
        "import ctypes, sys, gyre.rewards._confine as c; "
        "c.libc_unshare = lambda flags: (ctypes.set_errno(1), -1)[1]; "
        "import gyre.rewards._worker as w; sys.exit(w.main())"
    )
    monkeypatch.setattr(sandbox, "WORKER_ARGS", ["-c", refuse])
    cfg = RewardConfig.model_validate(
        {
            "functions": [{"fn": "reward_fixtures:chatty", "sandbox": True}],
            "sandbox": {"network": "deny"},
        }
    )
    with pytest.raises(SandboxUnavailableError) as err:
        Rewarder(cfg)
    assert "reward.sandbox.network=deny" in str(err.value)
    assert "Operation not permitted" in str(err.value)
    # asking for no isolation explicitly still works (and never calls unshare)
    allowed = cfg.model_copy(update={"sandbox": _sandbox(network="allow")})
    r = Rewarder(allowed)
    try:
        assert r.score_batch(_four())[1]["chatty"] == [0.5] * 4
    finally:
        r.close()
