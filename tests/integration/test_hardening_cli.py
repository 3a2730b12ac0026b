"""Hardening through ``gyre.cli.main``: every bad input is one stderr line naming the key or the
file (exit 2), a run whose weights turn nan stops with exit 3 and writes nothing, a full disk is
one line and leaves no staging folder, and an API key is written nowhere under run.dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gyre.trainer.core
from gyre.cli import main

RUN = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.intermediate_size=64",
    "log.console=off",
    "run.threads=1",
    "env.name=arithmetic",
    "sft.steps=0",
    "train.steps=2",
    "train.tasks_per_step=2",
    "train.group_size=2",
    "eval.episodes=0",
    "checkpoint.every=1",
]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _train(run_dir: Path, *extra: str) -> int:
    return main(["train", *RUN, f"run.dir={run_dir}", *extra])


# -- config and input errors: exit 2, one line ---------------------------------------------------
@pytest.mark.parametrize(
    "extra, words",
    [
        (["train.lr=inf"], ["train.lr", "finite"]),
        (["run.seed=-1"], ["run.seed"]),
        (["run.threads=100000"], ["run.threads"]),
        (["run.device=bogus"], ["run.device", "bogus"]),
        (["model.num_heads=3"], ["model.num_heads=3", "model.hidden_size=32"]),
        (["env.name=maze", "env.maze.min_distance=100"], ["env.maze.min_distance=100"]),
        (["train.sampling.temperature=1e-9"], ["train.sampling.temperature"]),
    ],
)
def test_bad_values_one_line_exit_2(tmp_path, capsys, extra, words):
    assert _train(tmp_path / "run", *extra) == 2
    line = _one_line(capsys)
    assert line.startswith("gyre: config error: ") and all(w in line for w in words), line
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_config_file_errors_name_file_and_line(tmp_path, capsys):
    bad = tmp_path / "latin.yaml"
    bad.write_bytes(b"train:\n  steps: 1\n# r\xe9sum\xe9\n")
    assert main(["train", str(bad)]) == 2
    line = _one_line(capsys)
    assert "latin.yaml' line 3: not UTF-8" in line
    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  steps: 1\ntrain:\n  lr: 0.1\n")
    assert main(["train", str(dup)]) == 2
    assert "dup.yaml" in (line := _one_line(capsys)) and "duplicate key 'train'" in line
    assert "line 3" in line


def test_model_path_with_broken_config_json(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 32,\n oops}')
    assert _train(tmp_path / "run", f"model.path={model}") == 2
    line = _one_line(capsys)
    assert f"{model / 'config.json'}:2: not valid JSON" in line


def test_run_dir_is_a_file(tmp_path, capsys):
    f = tmp_path / "run"
    f.write_text("not a dir")
    assert _train(f) == 2
    assert "run.dir=" in (line := _one_line(capsys)) and "a file is in the way" in line


def _dataset(tmp_path: Path, rows: list[bytes]) -> Path:
    p = tmp_path / "tasks.jsonl"
    p.write_bytes(b"\n".join(rows) + b"\n")
    return p


def test_dataset_latin1_row(tmp_path, capsys):
    rows = [b'{"prompt": "1+1=", "answer": "2"}', b'{"prompt": "\xe9", "answer": "1"}']
    p = _dataset(tmp_path, rows)
    assert _train(tmp_path / "run", "env.name=dataset", f"env.dataset.path={p}") == 2
    assert f"{p}:2: not UTF-8 text" in _one_line(capsys)


def test_dataset_prompt_longer_than_the_context(tmp_path, capsys):
    long = json.dumps({"prompt": "7" * 20_000, "answer": "7"}).encode()
    p = _dataset(tmp_path, [b'{"prompt": "1+1=", "answer": "2"}', long])
    assert _train(tmp_path / "run", "env.name=dataset", f"env.dataset.path={p}") == 2
    line = _one_line(capsys)
    assert f"{p}:2: prompt is 20001 tokens" in line and "1024 positions" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


# -- nan weights: exit 3, nothing saved ----------------------------------------------------------
def test_nan_weights_after_an_update_stop_with_exit_3(tmp_path, capsys, monkeypatch):
    real = gyre.trainer.core.policy_update

    def poisoned(model, *args, **kwargs):  # what train.lr=inf did: a finite loss, nan weights
        out = real(model, *args, **kwargs)
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.mul_(float("nan"))
        return out

    monkeypatch.setattr(gyre.trainer.core, "policy_update", poisoned)
    run = tmp_path / "run"
    assert _train(run) == 3
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("gyre: aborted: GRPO step 1:")
    assert "'model.layers.0.self_attn.q_proj.weight'" in line
    assert not (run / "final").exists()
    assert not (run / "checkpoints").exists() or list((run / "checkpoints").iterdir()) == []


# -- disk full: one line, no staging left ------------------------------------------------------
def test_final_disk_full(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GYRE_FAULT", "model.write:enospc")
    run = tmp_path / "run"
    assert _train(run) == 1
    line = _one_line(capsys)
    assert line == f"gyre: error: No space left on device writing {run / 'final'}"
    assert not (run / ".tmp_final").exists() and not (run / "final").exists()


def test_checkpoint_disk_full(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GYRE_FAULT", "checkpoint.write:enospc")
    run = tmp_path / "run"
    assert _train(run) == 1
    line = _one_line(capsys)
    assert line.startswith("gyre: error: No space left on device writing checkpoint ")
    assert "step_000001" in line
    assert list((run / "checkpoints").iterdir()) == []


# -- secrets and integrity on load, on one finished run ----------------------------------------
SECRET = "sk-gyre-test-0123456789"


@pytest.fixture(scope="module")
def keyed_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("keyed") / "run"
    assert _train(run, f"engine.api_key={SECRET}", "telemetry.tensorboard=false") == 0
    return run


def test_api_key_written_nowhere_under_run_dir(keyed_run):
    files = [p for p in keyed_run.rglob("*") if p.is_file()]
    assert any(p.name == "config.json" and "checkpoints" in p.parts for p in files)
    assert (keyed_run / "config.yaml").is_file()
    leaks = [p for p in files if SECRET.encode() in p.read_bytes()]
    assert leaks == []
    assert "api_key: '***'" in (keyed_run / "config.yaml").read_text()


def test_resume_with_another_key_is_the_same_run(keyed_run, capsys):
    # the hash ignores the secret: resuming with a rotated key is allowed (nothing to redo)
    assert _train(keyed_run, "engine.api_key=rotated", "run.resume=auto") == 0


def test_eval_and_export_refuse_a_tampered_folder(keyed_run, tmp_path, capsys):
    final = keyed_run / "final"
    assert (final / "manifest.json").is_file()
    copy = tmp_path / "final"
    copy.mkdir()
    for p in final.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    cfg = copy / "config.json"
    cfg.write_text(cfg.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    evalrun = f"run.dir={tmp_path / 'e'}"
    assert main(["eval", f"model.path={copy}", "eval.episodes=2", "log.console=off", evalrun]) == 2
    line = _one_line(capsys)
    assert f"{copy / 'manifest.json'} does not match the folder: config.json" in line
    run2 = tmp_path / "run2"
    run2.mkdir()
    (run2 / "final").symlink_to(copy, target_is_directory=True)
    assert main(["export", str(run2), "--out", str(tmp_path / "out")]) == 2
    assert "manifest.json does not match" in _one_line(capsys)
    assert not (tmp_path / "out").exists()


def test_export_refuses_nan_weights(tmp_path, capsys, make_tiny_model, tokenizer):
    run = tmp_path / "run"
    model = make_tiny_model()
    with torch.no_grad():
        model.lm_head.weight[3, 1] = float("inf")
    model.save_pretrained(run / "final")  # as if written by an older gyre: no check, no manifest
    tokenizer.save_pretrained(run / "final")
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 1
    line = _one_line(capsys)
    assert "tensor 'model.embed_tokens.weight'" in line or "tensor 'lm_head.weight'" in line
    assert not (tmp_path / "out").exists()


# -- the error path itself -----------------------------------------------------------------------
def test_unexpected_error_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    import gyre.runners

    def boom(cfg):
        raise KeyError("surprise")

    monkeypatch.setattr(gyre.runners, "train", boom)
    assert _train(tmp_path / "run") == 1
    line = _one_line(capsys)
    assert line.startswith("gyre: internal error: KeyError: 'surprise'") and "--debug" in line
    assert main(["train", "--debug", *RUN, f"run.dir={tmp_path / 'run2'}"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "surprise" in err
