"""Hardening without training: bad config values, secrets, non-finite weights, disk-full
wording, bad input files -- each one refused with one line that names the key or the file."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from gyre.checkpoint.files import check_manifest, write_manifest
from gyre.checkpoint.identity import config_hash
from gyre.checkpoint.resume import FaultAbort, check_parameters_finite
from gyre.checkpoint.snapshot import Snapshot, save
from gyre.checkpoint.store import (
    CheckpointError,
    CheckpointStore,
    NonFiniteError,
    set_fault_hook,
    write_model_dir,
)
from gyre.config import REDACTED, ConfigError, EngineConfig, dump_config, load_config
from gyre.engines.credentials import resolve_api_key
from gyre.envs.dataset import load_jsonl_tasks
from gyre.errors import InputError, ensure_writable_dir
from gyre.models.build import load_pretrained


def _err(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# -- 1. NaN / inf and ranges in the config ------------------------------------------------------
@pytest.mark.parametrize(
    "override, key",
    [
        ("train.lr=inf", "train.lr"),
        ("train.lr=nan", "train.lr"),
        ("sft.lr=.inf", "sft.lr"),
        ("train.lr=-.inf", "train.lr"),
        ("train.clip_eps=nan", "train.clip_eps"),
        ("reward.env_weight=.nan", "reward.env_weight"),  # no range, still finite
        ("train.algo.entropy_coef=inf", "train.algo.entropy_coef"),
        ("engine.timeout_s=inf", "engine.timeout_s"),
    ],
)
def test_nonfinite_floats_are_refused_with_the_key(override, key):
    msg = _err([override])
    assert key in msg and "finite" in msg


@pytest.mark.parametrize(
    "override, key, words",
    [
        ("train.lr=5", "train.lr", "less than or equal to 1"),
        ("train.lr=0", "train.lr", "greater than 0"),
        ("train.algo.critic_lr=2", "train.algo.critic_lr", "less than or equal to 1"),
        ("train.sampling.temperature=1e-5", "train.sampling.temperature", "0 (greedy)"),
        ("train.sampling.temperature=-1", "train.sampling.temperature", "greater than"),
        ("run.threads=100000", "run.threads", "cores"),
        ("run.seed=-1", "run.seed", "greater than or equal to 0"),
        ("run.seed=1e20", "run.seed", "integer"),
        (f"run.seed={2**32}", "run.seed", "less than"),
        ("run.device=bogus", "run.device", "'cpu', 'cuda', 'cuda:N'"),
    ],
)
def test_out_of_range_values_name_the_key(override, key, words):
    msg = _err([override])
    assert key in msg and words in msg


def test_valid_edges_are_accepted():
    cfg = load_config(
        None,
        [
            "train.lr=1",
            "train.sampling.temperature=0",
            "train.sampling.temperature=0.01",
            f"run.seed={2**32 - 1}",
            f"run.threads={4 * (os.cpu_count() or 1)}",
            "run.device=cuda:1",
        ],
    )
    assert cfg.run.seed == 2**32 - 1 and cfg.train.sampling.temperature == 0.01


def test_heads_must_split_hidden_evenly_naming_both_keys():
    msg = _err(["model.num_heads=3"])
    assert "model.num_heads=3" in msg and "model.hidden_size=128" in msg
    load_config(None, ["model.num_heads=3", "model.path=/some/model"])  # tiny keys unused there


def test_impossible_maze_names_the_keys():
    msg = _err(["env.maze.min_distance=100"])
    assert "env.maze.min_distance=100" in msg and "env.maze.size=5" in msg


def test_maze_generator_failure_names_the_keys():
    from gyre.envs.maze import MazeEnv

    env = MazeEnv(size=5, wall_density=0.3, min_distance=25)  # > the 24 other cells
    with pytest.raises(ConfigError, match=r"env\.maze\.min_distance=25.*env\.maze\.wall_density"):
        env.reset(0)


def test_parameters_checked_after_an_optimizer_step(make_tiny_model):
    """The probe's case (train.lr=inf, now refused by the config): one AdamW step on a finite
    loss turns the weights into nan/inf; the check after the step names step and parameter."""
    model = make_tiny_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=float("inf"))
    check_parameters_finite(model, "GRPO", 1)  # fine before
    ids = torch.tensor([[5, 6, 7, 8]])
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    opt.step()
    with pytest.raises(FaultAbort, match=r"GRPO step 7: .*parameter 'model\.[a-z_.0-9]+weight'"):
        check_parameters_finite(model, "GRPO", 7)


def _poison(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    return model


def test_nonfinite_model_dir_is_refused(tmp_path, make_tiny_model, tokenizer):
    model = _poison(make_tiny_model())
    with pytest.raises(NonFiniteError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.* 1 non-fin"):
        write_model_dir(tmp_path / "final", model, tokenizer)
    assert list(tmp_path.iterdir()) == []  # neither final/ nor a staging folder


def test_nonfinite_checkpoint_is_refused(tmp_path, make_tiny_model, tokenizer):
    model = _poison(make_tiny_model())
    opt = torch.optim.AdamW(model.parameters())
    store = CheckpointStore(tmp_path / "ckpts")
    with pytest.raises(NonFiniteError, match="up_proj"):
        save(store, "step_000001", model, tokenizer, Snapshot(1, {}, opt))
    assert store.names() == []


# -- 2. secrets ---------------------------------------------------------------------------------
def test_api_key_redacted_in_dumps_and_ignored_by_the_hash():
    secret = "sk-very-secret-123"
    cfg = load_config(None, [f"engine.api_key={secret}"])
    assert secret not in dump_config(cfg)
    assert secret not in repr(cfg) and secret not in json.dumps(cfg.model_dump(mode="json"))
    assert cfg.model_dump(mode="json")["engine"]["api_key"] == REDACTED
    plain = load_config(None, [])
    assert config_hash(cfg.model_dump(mode="json")) == config_hash(plain.model_dump(mode="json"))
    assert resolve_api_key(cfg.engine) == secret  # the engine still gets the real one


def test_api_key_error_never_echoes_the_value():
    msg = _err(["engine.api_key=[sk-secret, x]"])
    assert "sk-secret" not in msg and "engine.api_key" in msg


def test_api_key_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("GYRE_API_KEY", raising=False)
    assert resolve_api_key(EngineConfig()) == ""
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    e = EngineConfig(api_key_file=str(key_file))
    assert resolve_api_key(e) == "from-file"
    monkeypatch.setenv("GYRE_API_KEY", "from-env")
    assert resolve_api_key(e) == "from-env"  # the environment wins over the file
    assert resolve_api_key(EngineConfig(api_key="direct")) == "direct"
    monkeypatch.delenv("GYRE_API_KEY")
    # a config read back from a run dir: the placeholder is not a key
    with pytest.raises(ConfigError, match="GYRE_API_KEY"):
        resolve_api_key(EngineConfig(api_key=REDACTED))
    with pytest.raises(ConfigError, match=r"engine\.api_key_file"):
        resolve_api_key(EngineConfig(api_key_file=str(tmp_path / "missing")))


def test_http_engine_sends_the_real_key(tmp_path, monkeypatch, make_tiny_model, tokenizer):
    pytest.importorskip("httpx")
    from gyre.engines.factory import build_engine

    monkeypatch.setenv("GYRE_API_KEY", "sk-env-456")
    cfg = load_config(None, ["engine.kind=http", "engine.urls=[http://127.0.0.1:9]"])
    engine, _ = build_engine(cfg, make_tiny_model(), tokenizer, tmp_path)
    try:
        assert engine.pool.client.headers["authorization"] == "Bearer sk-env-456"
    finally:
        engine.close()
    assert "sk-env-456" not in dump_config(cfg)


# -- 3. files ----------------------------------------------------------------------------------
def test_config_file_not_utf8_names_file_and_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"train:\n  steps: 3  # caf\xe9\n")
    with pytest.raises(ConfigError, match=r"c\.yaml' line 2: not UTF-8"):
        load_config(p)


def test_duplicate_yaml_key_names_key_and_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  steps: 3\nsft:\n  steps: 1\ntrain:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"line 5.*duplicate key 'train' \(first on line 1\)"):
        load_config(p)
    p.write_text("train:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(ConfigError, match=r"line 3.*duplicate key 'steps'"):
        load_config(p)
    p.write_text("train: {steps: 3, steps: 4}\n")  # flow style, one line
    with pytest.raises(ConfigError, match=r"line 1.*duplicate key 'steps'"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"duplicate key 'rank'"):
        load_config(None, ["model.lora={rank: 4, rank: 8}"])


def test_model_config_not_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match=r"config\.json:1: not valid JSON"):
        load_pretrained(tmp_path, torch.device("cpu"))


def test_dataset_latin1_row_names_file_and_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_bytes(b'{"prompt": "a", "answer": "1"}\n\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(InputError, match=r"t\.jsonl:3: not UTF-8 text \(byte 0xe9"):
        load_jsonl_tasks(p)


def test_long_prompt_is_refused_with_file_line(tmp_path, tokenizer):
    from gyre.envs import env_factory
    from gyre.rollout.context import check_prompts

    p = tmp_path / "t.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "x" * 20_000, "answer": "3"}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config(None, ["env.name=dataset", f"env.dataset.path={p}"])
    with pytest.raises(InputError, match=r"t\.jsonl:2: prompt is 20001 tokens.*1024 positions"):
        check_prompts(cfg, env_factory(cfg.env), tokenizer, 1024)
    check_prompts(cfg, env_factory(cfg.env), tokenizer, None)  # unknown limit (HTTP): no check
    maze = load_config(None, ["env.maze.size=40", "env.maze.observation=grid"])
    with pytest.raises(InputError, match=r"env\.name=maze: the first observation is \d+ tokens"):
        check_prompts(maze, env_factory(maze.env), tokenizer, 1024)


def test_run_dir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(InputError, match=r"run\.dir='.*file': a file is in the way"):
        ensure_writable_dir(f, "run.dir")
    with pytest.raises(InputError, match="a file is in the way"):
        ensure_writable_dir(f / "sub", "run.dir")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_run_dir_read_only(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(InputError, match=r"run\.dir='.*ro' is not writable"):
            ensure_writable_dir(ro, "run.dir")
    finally:
        ro.chmod(0o755)


def test_run_dir_not_writable_simulated(tmp_path, monkeypatch):
    """The same refusal where the test runs as root (chmod does not stop root)."""

    def denied(self: Path, data: bytes) -> int:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    monkeypatch.setattr(Path, "write_bytes", denied)
    with pytest.raises(InputError, match=r"run\.dir='.*' is not writable: Permission denied"):
        ensure_writable_dir(tmp_path, "run.dir")


# -- disk full ------------------------------------------------------------------------------------
def _raise(exc: BaseException):
    def hook() -> None:
        raise exc

    return hook


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
        # what safetensors' writer raises on a full disk (save_pretrained of final/)
        pytest.param("safetensors", id="SafetensorError"),
    ],
)
def test_final_dir_disk_full_is_one_line_and_cleaned_up(tmp_path, make_tiny_model, tokenizer, exc):
    if exc == "safetensors":
        from safetensors import SafetensorError

        exc = SafetensorError(
            "Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
            '"No space left on device" })'
        )
    set_fault_hook("model.write", _raise(exc))
    try:
        with pytest.raises(CheckpointError) as info:
            write_model_dir(tmp_path / "final", make_tiny_model(), tokenizer)
    finally:
        set_fault_hook("model.write", None)
    assert str(info.value) == f"No space left on device writing {tmp_path / 'final'}"
    assert list(tmp_path.iterdir()) == []  # no .tmp_final left behind


def test_checkpoint_torch_writer_failure_on_full_disk(
    tmp_path, make_tiny_model, tokenizer, monkeypatch
):
    """torch's zip writer says only 'enforce fail at inline_container.cc': with the disk (almost)
    full that is reported as a full disk; with space left, as the writer's first line."""
    import gyre.errors

    torch_msg = (
        "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
        "data/0: file write failed\nframe #0: c10::ThrowEnforceNotMet(...)"
    )
    model = make_tiny_model()
    opt = torch.optim.AdamW(model.parameters())
    store = CheckpointStore(tmp_path / "ckpts")
    set_fault_hook("checkpoint.write", _raise(RuntimeError(torch_msg)))
    try:
        monkeypatch.setattr(gyre.errors, "free_bytes", lambda p: 4096)
        with pytest.raises(CheckpointError) as full:
            save(store, "step_000001", model, tokenizer, Snapshot(1, {}, opt))
        monkeypatch.setattr(gyre.errors, "free_bytes", lambda p: 1 << 40)
        with pytest.raises(CheckpointError) as other:
            save(store, "step_000001", model, tokenizer, Snapshot(1, {}, opt))
    finally:
        set_fault_hook("checkpoint.write", None)
    assert str(full.value).startswith("No space left on device writing checkpoint ")
    assert "step_000001" in str(full.value) and "\n" not in str(full.value)
    assert "inline_container.cc" in str(other.value) and "\n" not in str(other.value)
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == []  # staging removed


# -- 4. integrity on load -------------------------------------------------------------------------
def test_check_manifest(tmp_path, make_tiny_model, tokenizer):
    final = write_model_dir(tmp_path / "final", make_tiny_model(), tokenizer)
    check_manifest(final)  # verifies
    (final / "config.json").write_text((final / "config.json").read_text() + " ")
    with pytest.raises(InputError, match=r"manifest\.json does not match the folder: config\.json"):
        check_manifest(final)
    other = tmp_path / "foreign"
    other.mkdir()
    (other / "config.json").write_text("{}")
    check_manifest(other)  # no manifest: a model from elsewhere, loaded as is
    write_manifest(other, {})
    (other / "config.json").unlink()
    with pytest.raises(InputError, match=r"config\.json missing"):
        check_manifest(other)


def test_submitted_job_gets_the_key_by_environment(tmp_path):
    from gyre.runners.submit import build_job

    job = build_job(None, ["engine.api_key=sk-job-789", "train.steps=2"], str(tmp_path))
    assert "sk-job-789" not in job["entrypoint"] and "train.steps=2" in job["entrypoint"]
    assert job["runtime_env"]["env_vars"] == {"GYRE_API_KEY": "sk-job-789"}


def test_check_manifest_of_a_checkpoint_model_dir(tmp_path, make_tiny_model, tokenizer):
    model = make_tiny_model()
    store = CheckpointStore(tmp_path / "ckpts")
    path = Path(
        save(
            store,
            "step_000001",
            model,
            tokenizer,
            Snapshot(1, {}, torch.optim.SGD(model.parameters(), lr=0.1)),
        )
    )
    check_manifest(path / "model")
    (path / "model" / "config.json").write_text("{}")
    with pytest.raises(InputError, match=r"step_000001/manifest\.json does not match"):
        check_manifest(path / "model")
