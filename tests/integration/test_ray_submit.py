"""``gyre submit`` against a local Ray head (with its dashboard / Jobs API) started here."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.dashboard")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path, tmp_path_factory):
    yield from _head(tmp_path, tmp_path_factory, {"RAY_AUTH_MODE": "disabled"})


def _head(tmp_path, tmp_path_factory, auth: dict, headers: dict | None = None):
    """``ray start --head --block`` in its own process group, every port asked of the OS."""
    ray_bin = Path(sys.executable).parent / "ray"
    dash = _free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")},
        **auth,
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    cmd = [
        str(ray_bin), "start", "--head", "--block", "--num-cpus=2",
        "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
        f"--port={_free_port()}", f"--dashboard-port={dash}",
        f"--ray-client-server-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}",
        f"--metrics-export-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}",
        # Unix socket paths are capped at 107 bytes: keep the session dir short.
        f"--temp-dir={tmp_path_factory.mktemp('h')}",
    ]  # fmt: skip
    log = (tmp_path / "head.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    address = f"http://127.0.0.1:{dash}"
    from ray.job_submission import JobSubmissionClient

    deadline = time.time() + 120
    while True:
        try:
            JobSubmissionClient(address, headers=headers).list_jobs()
            break
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                pytest.fail("the Ray head did not start:\n" + (tmp_path / "head.log").read_text())
            time.sleep(1)
    yield address
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()


@pytest.mark.slow  # a Ray head and a job: ~85 s with start-up and teardown
def test_gyre_submit_runs_a_ray_job_on_a_local_head(ray_head, tmp_path, capsys):
    from gyre.cli import main

    work = tmp_path / "work"
    work.mkdir()
    (work / "run.yaml").write_text(
        "model: {hidden_size: 32, num_layers: 2, num_heads: 4, intermediate_size: 64}\n"
        "sft: {steps: 0}\n"
        "train: {steps: 2, tasks_per_step: 2, group_size: 2}\n"
        "eval: {episodes: 4}\n"
        "log: {console: plain}\n"
        "runner: ray\n"
        "ray: {rollout_workers: 1, rollout: {num_cpus: 0.5}, trainer: {num_cpus: 0.5}}\n"
    )
    run_dir = tmp_path / "out"
    rc = main([
        "submit", str(work / "run.yaml"), f"run.dir={run_dir}", "run.threads=1",
        "--address", ray_head, "--working-dir", str(work), "--python", sys.executable,
        "--env", "RAY_AUTH_MODE=disabled",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "SUCCEEDED" in out
    assert "step 2/2" in out  # the job's log was followed
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["runner"] == "ray" and summary["steps"] == 2


def test_submit_refuses_a_config_outside_the_working_dir(tmp_path):
    from gyre.runners.submit import build_job

    (tmp_path / "w").mkdir()
    (tmp_path / "c.yaml").write_text("train: {steps: 1}\n")
    with pytest.raises(ValueError, match="outside --working-dir"):
        build_job(str(tmp_path / "c.yaml"), [], str(tmp_path / "w"))
    job = build_job(str(tmp_path / "c.yaml"), ["train.steps=2"], str(tmp_path), pip=["x"])
    assert job["entrypoint"] == "python -m gyre.cli train c.yaml train.steps=2"
    assert job["runtime_env"] == {"working_dir": str(tmp_path), "pip": ["x"]}


TOKEN_RUN = (
    "model: {hidden_size: 32, num_layers: 2, num_heads: 4, intermediate_size: 64}\n"
    "sft: {steps: 0}\n"
    "train: {steps: 1, tasks_per_step: 2, group_size: 2}\n"
    "eval: {episodes: 0}\n"
    "log: {console: plain}\n"
    "runner: ray\n"
    "ray: {rollout_workers: 1, rollout: {num_cpus: 0.5}, trainer: {num_cpus: 0.5}}\n"
)


@pytest.fixture
def token_head(tmp_path, tmp_path_factory):
    """A head with Ray's token authentication on, its token in a file only it reads."""
    import secrets

    token = secrets.token_hex(16)
    path = tmp_path / "cluster-token"
    path.write_text(token)
    path.chmod(0o600)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}
    for address in _head(tmp_path, tmp_path_factory, auth, {"Authorization": f"Bearer {token}"}):
        yield address, token


def _submit(address: str, work: Path, run_dir: Path, *extra: str) -> int:
    from gyre.cli import main

    return main([
        "submit", str(work / "run.yaml"), f"run.dir={run_dir}", "run.threads=1",
        "--address", address, "--working-dir", str(work), "--python", sys.executable, *extra,
    ])  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GYRE_SLOW") != "1", reason="slow: set GYRE_SLOW=1")
def test_submit_to_a_token_head_refuses_a_missing_or_wrong_token(
    token_head, tmp_path, capsys, monkeypatch
):
    address, _ = token_head
    work = tmp_path / "work"
    work.mkdir()
    (work / "run.yaml").write_text(TOKEN_RUN)
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token either
    assert _submit(address, work, tmp_path / "a") == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"gyre submit: the Ray head at {address} requires a token (no token given): pass "
        "--token-file FILE or set RAY_AUTH_TOKEN"
    )
    wrong = tmp_path / "wrong"
    wrong.write_text("0" * 32)
    assert _submit(address, work, tmp_path / "b", "--token-file", str(wrong)) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == f"gyre submit: the Ray head at {address} refused the token from --token-file {wrong}"
    )
    monkeypatch.setenv("RAY_AUTH_TOKEN", "1" * 32)
    assert _submit(address, work, tmp_path / "c") == 2
    assert capsys.readouterr().err.strip().endswith("refused the token from RAY_AUTH_TOKEN")
    assert _submit(address, work, tmp_path / "d", "--token-file", str(tmp_path / "nope")) == 2
    assert (
        "--token-file" in capsys.readouterr().err
        and "no such file" in str(tmp_path / "nope") + "no such file"
    )


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GYRE_SLOW") != "1", reason="slow: set GYRE_SLOW=1")
def test_submit_to_a_token_head_runs_the_job_and_never_shows_the_token(
    token_head, tmp_path, capsys, monkeypatch
):
    address, token = token_head
    work = tmp_path / "work"
    work.mkdir()
    (work / "run.yaml").write_text(TOKEN_RUN)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)  # from the environment, not the command line
    run_dir = tmp_path / "out"
    rc = _submit(address, work, run_dir)
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert "SUCCEEDED" in out.out
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1
    assert token not in out.out + out.err
    for f in run_dir.rglob("*"):
        if f.is_file() and f.suffix in (".json", ".jsonl", ".yaml", ".txt", ".log"):
            assert token not in f.read_text(errors="ignore"), f
