"""``gyre submit CONFIG --address http://HEAD:8265``: run ``gyre train`` as a Ray job.

The Ray Jobs API (``ray.job_submission.JobSubmissionClient``) uploads the working directory
(``--working-dir``, default the current one) and starts the entrypoint
``python -m gyre.cli train CONFIG key=value ...`` on the head node, inside the runtime
environment (``--pip`` packages, environment variables). Inside the job ``RAY_ADDRESS`` is set,
so a ``runner: ray`` config joins that cluster instead of starting one. With ``--follow`` (the
default) the job's log is streamed until it ends and the exit status says whether it succeeded.

A head started with Ray's token authentication (``RAY_AUTH_MODE=token``) wants its token on
every request (``Authorization: Bearer ...``). :func:`read_token` takes it from
``--token-file FILE``, else ``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH`` names,
else Ray's default ``~/.ray/auth_token``: never from the command line, and it is never printed.
A missing or wrong token is one line (:class:`SubmitError`).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.config import load_config
from gyre.engines.credentials import secrets_to_env
from gyre.runners.placement import require_ray


class SubmitError(RuntimeError):
    """A submission the head refused or could not take (one line)."""


def read_token(token_file: str | None = None) -> tuple[str | None, str]:
    """(the cluster's auth token or None, where it came from -- never the token itself)."""
    if token_file:
        path = Path(token_file).expanduser()
        if not path.is_file():
            raise SubmitError(f"--token-file '{token_file}': no such file")
        token, source = path.read_text().strip(), f"--token-file {token_file}"
    elif os.environ.get("RAY_AUTH_TOKEN"):
        token, source = os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN"
    else:
        env_path = os.environ.get("RAY_AUTH_TOKEN_PATH")
        path = Path(env_path or "~/.ray/auth_token").expanduser()
        if not path.is_file():
            if env_path:
                raise SubmitError(f"RAY_AUTH_TOKEN_PATH '{env_path}': no such file")
            return None, "no token"
        token = path.read_text().strip()
        source = "RAY_AUTH_TOKEN_PATH" if env_path else str(path)
    if not token:
        raise SubmitError(f"the token from {source} is empty")
    return token, source


def _auth_failure(exc: Exception, address: str, source: str) -> SubmitError:
    text = str(exc)
    if "Authentication required" in text:
        return SubmitError(
            f"the Ray head at {address} requires a token ({source} given): pass --token-file "
            "FILE or set RAY_AUTH_TOKEN"
        )
    if "Authentication failed" in text:
        return SubmitError(f"the Ray head at {address} refused the token from {source}")
    return SubmitError(f"the Ray head at {address}: {text.splitlines()[0] if text else exc!r}")


def build_job(
    config: str | None,
    overrides: list[str],
    working_dir: str,
    pip: list[str] | None = None,
    env_vars: dict[str, str] | None = None,
    python: str = "python",
) -> dict[str, Any]:
    """The ``submit_job`` arguments; the config is validated here before anything is sent."""
    load_config(config, overrides)  # fail on the laptop, not on the cluster
    wd = Path(working_dir).resolve()
    if not wd.is_dir():
        raise FileNotFoundError(f"--working-dir '{working_dir}' is not a directory")
    args, secret_env = secrets_to_env(list(overrides))  # the key travels in the job's env
    env_vars = {**(env_vars or {}), **secret_env}
    if config is not None:
        cp = Path(config).resolve()
        try:
            rel = cp.relative_to(wd)
        except ValueError:
            raise ValueError(
                f"config '{config}' is outside --working-dir '{wd}'; the job only sees the "
                "uploaded working directory"
            ) from None
        args.insert(0, rel.as_posix())
    runtime_env: dict[str, Any] = {"working_dir": str(wd)}
    if pip:
        runtime_env["pip"] = list(pip)
    if env_vars:
        runtime_env["env_vars"] = dict(env_vars)
    entrypoint = shlex.join([python, "-m", "gyre.cli", "train", *args])
    return {"entrypoint": entrypoint, "runtime_env": runtime_env}


async def _follow(client: Any, job_id: str) -> None:
    async for lines in client.tail_job_logs(job_id):
        sys.stdout.write(lines)
        sys.stdout.flush()


@dataclass(frozen=True)
class JobRuntime:
    """Where and how the job runs (``gyre submit``'s ``--working-dir``, ``--pip``, ``--env``,
    ``--python``): see :func:`build_job`."""

    working_dir: str = "."
    pip: list[str] | None = None
    env_vars: dict[str, str] | None = None
    python: str = "python"


def submit(
    address: str,
    config: str | None,
    overrides: list[str],
    runtime: JobRuntime | None = None,
    follow: bool = True,
    token_file: str | None = None,
) -> tuple[str, str]:
    """Submit; return (job id, final status -- or 'PENDING'/'RUNNING' without ``follow``)."""
    require_ray()
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    r = runtime or JobRuntime()
    job = build_job(config, overrides, r.working_dir, r.pip, r.env_vars, r.python)
    token, source = read_token(token_file)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        client = JobSubmissionClient(address, headers=headers)
        job_id = client.submit_job(**job)
    except AuthenticationError as exc:
        raise _auth_failure(exc, address, source) from None
    except ConnectionError as exc:
        raise SubmitError(f"cannot reach the Ray dashboard at {address}: {exc}") from None
    print(f"submitted {job_id} to {address}: {job['entrypoint']}", flush=True)
    if not follow:
        return job_id, str(client.get_job_status(job_id).value)
    asyncio.run(_follow(client, job_id))
    return job_id, str(client.get_job_status(job_id).value)
