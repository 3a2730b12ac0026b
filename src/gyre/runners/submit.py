"""``gyre submit CONFIG --address http://HEAD:8265``: run ``gyre train`` as a Ray job.

The Ray Jobs API (``ray.job_submission.JobSubmissionClient``) uploads the working directory
(``--working-dir``, default the current one) and starts the entrypoint
``python -m gyre.cli train CONFIG key=value ...`` on the head node, inside the runtime
environment (``--pip`` packages, environment variables). Inside the job ``RAY_ADDRESS`` is set,
so a ``runner: ray`` config joins that cluster instead of starting one. With ``--follow`` (the
default) the job's log is streamed until it ends and the exit status says whether it succeeded.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.config import load_config
from gyre.engines.credentials import secrets_to_env
from gyre.runners.placement import require_ray


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
) -> tuple[str, str]:
    """Submit; return (job id, final status -- or 'PENDING'/'RUNNING' without ``follow``)."""
    require_ray()
    from ray.job_submission import JobSubmissionClient

    r = runtime or JobRuntime()
    job = build_job(config, overrides, r.working_dir, r.pip, r.env_vars, r.python)
    client = JobSubmissionClient(address)
    job_id = client.submit_job(**job)
    print(f"submitted {job_id} to {address}: {job['entrypoint']}", flush=True)
    if not follow:
        return job_id, str(client.get_job_status(job_id).value)
    asyncio.run(_follow(client, job_id))
    return job_id, str(client.get_job_status(job_id).value)
