"""CLI argument handling that does not train anything."""

from __future__ import annotations

import pytest

from gyre.cli import main


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("train", "sft", "eval"):
        assert cmd in out


def test_subcommand_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    assert "CONFIG.yaml" in capsys.readouterr().out


def test_help_config_lists_keys(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help-config"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "train.steps" in out and "env.maze.size" in out


def test_no_command_is_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_config_error_exit_code_2(capsys, tmp_path):
    assert main(["train", "train.stepz=3", f"run.dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert "train.stepz" in err
    assert not (tmp_path / "r").exists()  # nothing was started


def test_bad_value_exit_code_2(capsys):
    assert main(["sft", "train.lr=abc"]) == 2
    err = capsys.readouterr().err
    assert "train.lr" in err and "abc" in err


def test_missing_config_file_exit_code_2(capsys, tmp_path):
    missing = tmp_path / "missing.yaml"
    assert main(["train", str(missing)]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_eval_needs_model_path(capsys):
    assert main(["eval", "log.console=off"]) == 2
    assert "model.path" in capsys.readouterr().err
