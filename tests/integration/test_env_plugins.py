"""A user's env outside the package, as a new user writes one: a .py file next to the config,
named by file path (no PYTHONPATH), trained for 2 steps with ``gyre train`` and evaluated with
``gyre eval``; import paths, the registry, env.kwargs and the errors that name the field.

Also: ``final/`` and ``sft/`` record the env they were trained on (``gyre_env.json``), and
``gyre eval`` / ``gyre train`` on them use it unless ``env.*`` is set.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from gyre.cli import main
from gyre.config import ConfigError, EnvConfig, load_config
from gyre.envs import env_factory, register
from gyre.runners.placement import user_module_path
from helpers import TINY_ARITHMETIC_RUN

GUESS = textwrap.dedent(
    '''
    """Guess the number: a user's env, with no demonstrator."""
    import random


    class GuessNumber:
        def __init__(self, high=9, bonus=1.0):
            self.high, self.bonus, self.target = high, bonus, 0

        def reset(self, seed):
            self.target = random.Random(seed).randint(0, self.high)
            return f"guess 0-{self.high}:"

        def step(self, action):
            ok = action.strip() == str(self.target)
            return "", self.bonus if ok else 0.0, True, {"success": ok}
    '''
)
REWARD = "def length(prompts, completions, **kw):\n    return [0.1 * len(c) for c in completions]\n"
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.intermediate_size=64"]
QUIET = ["log.console=off", "run.threads=1", "eval.episodes=4", "eval.sampled=false"]


@pytest.fixture()
def project(tmp_path, monkeypatch):
    """A user's project folder (env + reward files + config) and another cwd to run from."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "guess_env.py").write_text(GUESS)
    (proj / "my_rewards.py").write_text(REWARD)
    cfg = proj / "config.yaml"
    cfg.write_text(
        textwrap.dedent(
            """
            env:
              name: guess_env.py:GuessNumber
              kwargs: {high: 2, bonus: 2.0}
            reward:
              functions:
                - {fn: my_rewards.py:length, weight: 0.5}
            sft: {steps: 0}
            train: {steps: 2, tasks_per_step: 2, group_size: 2, mini_batches: 1}
            """
        )
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))  # plug-in loading may add folders
    return proj, cfg


def test_file_env_trains_and_evaluates_from_another_cwd(project, tmp_path, capsys):
    proj, cfg = project
    run = tmp_path / "run"
    assert main(["train", str(cfg), f"run.dir={run}", *TINY, *QUIET]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/length_mean" in r for r in rows)  # the file-path reward ran
    # the resolved config names the files by absolute path (what Ray actors and resumes read)
    saved = load_config(run / "config.yaml")
    assert saved.env.name == f"{proj / 'guess_env.py'}:GuessNumber"
    assert saved.reward.functions[0].fn == f"{proj / 'my_rewards.py'}:length"
    record = json.loads((run / "final" / "gyre_env.json").read_text())
    assert record["env"]["name"] == saved.env.name and record["env"]["kwargs"]["high"] == 2
    # gyre eval on final/ with no env.* given: the recorded plug-in env, said in one line
    capsys.readouterr()
    out = tmp_path / "eval"
    assert main(["eval", f"model.path={run / 'final'}", f"run.dir={out}", *QUIET]) == 0
    err = capsys.readouterr().err
    assert "env.name=" in err and "gyre_env.json" in err
    res = json.loads((out / "eval.json").read_text())
    assert res["eval/moves_greedy"] == 1.0  # one guess per episode: the guess env, no maze


def test_sft_on_an_env_without_demonstrator_is_a_one_line_error(project, tmp_path, capsys):
    _, cfg = project
    rc = main(["train", str(cfg), f"run.dir={tmp_path / 'r'}", "sft.steps=5", *TINY, *QUIET])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1
    assert "env.name=" in err and "GuessNumber" in err and "sft.steps=0" in err


def test_import_path_from_cwd_registry_and_kwargs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    (tmp_path / "guess_mod_cwd.py").write_text(GUESS)
    make = env_factory(EnvConfig(name="guess_mod_cwd:GuessNumber", kwargs={"high": 0}))
    env = make()
    assert env.reset(1) == "guess 0-0:" and env.step("0")[1] == 1.0
    # a Ray actor gets the module's folder on PYTHONPATH, as the driver found it
    cfg = load_config(overrides=["env.name=guess_mod_cwd:GuessNumber"])
    assert str(tmp_path) in user_module_path(cfg).split(":")
    # the registry
    register("guess-test", type(env))
    env2 = env_factory(EnvConfig(name="guess-test", kwargs={"high": 5}))()
    assert env2.reset(3) == "guess 0-5:"
    with pytest.raises(ValueError, match="cannot register env 'maze'"):
        register("maze", type(env))


def test_bad_plugin_configs_name_the_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"'env.name': 'nope' \(Value error, unknown env; valid"):
        load_config(overrides=["env.name=nope"])
    with pytest.raises(ValueError, match=r"env.name: cannot import module 'no_such_mod_xyz'"):
        env_factory(EnvConfig(name="no_such_mod_xyz:Env"))
    with pytest.raises(ConfigError, match=r"env.name: file 'missing.py' not found"):
        load_config(overrides=["env.name=missing.py:Env"])
    with pytest.raises(ConfigError, match=r"env.kwargs is for plug-in envs"):
        load_config(overrides=["env.name=maze", "env.kwargs={size: 3}"])
    (tmp_path / "g.py").write_text(GUESS + "\nNOT_AN_ENV = dict\n")
    cfg = load_config(overrides=["env.name=g.py:GuessNumber", "env.kwargs={colour: red}"])
    with pytest.raises(ValueError, match=r"env.kwargs=\{'colour': 'red'\}"):
        env_factory(cfg.env)
    with pytest.raises(ValueError, match=r"made a dict, which has no reset"):
        env_factory(load_config(overrides=["env.name=g.py:NOT_AN_ENV"]).env)


def test_eval_and_train_use_the_env_a_model_was_trained_on(tmp_path, capsys):
    """`gyre sft env.name=arithmetic` then `gyre eval` / `gyre train` on its sft/ folder: both
    run on arithmetic (the recorded env), and an explicit env.* still wins."""
    sft_run = tmp_path / "sft_run"
    args = ["sft", f"run.dir={sft_run}", *TINY_ARITHMETIC_RUN, "sft.steps=2", "sft.demos=8",
            "sft.batch_size=4", *QUIET]  # fmt: skip
    assert main(args) == 0
    sft = sft_run / "sft"
    assert json.loads((sft / "gyre_env.json").read_text())["env"]["name"] == "arithmetic"
    capsys.readouterr()
    ev = tmp_path / "ev"
    assert main(["eval", f"model.path={sft}", f"run.dir={ev}", *QUIET]) == 0
    assert "env.name=arithmetic" in capsys.readouterr().err
    assert load_config(ev / "config.yaml").env.arithmetic.max_operand == 2
    assert json.loads((ev / "eval.json").read_text())["eval/moves_greedy"] == 1.0
    tr = tmp_path / "tr"
    args = [
        "train",
        f"model.path={sft}",
        f"run.dir={tr}",
        "sft.steps=0",
        "train.steps=1",
        "train.tasks_per_step=2",
        "train.group_size=2",
        "train.mini_batches=1",
        *QUIET,
    ]
    assert main(args) == 0
    assert load_config(tr / "config.yaml").env.name == "arithmetic"
    # an explicit env.* wins, with a note
    capsys.readouterr()
    ev2 = tmp_path / "ev2"
    assert main(["eval", f"model.path={sft}", f"run.dir={ev2}", "env.name=maze", *QUIET]) == 0
    assert "was trained on env.name=arithmetic" in capsys.readouterr().err
    assert load_config(ev2 / "config.yaml").env.name == "maze"


def test_records_are_in_every_model_folder_writer(tmp_path, make_tiny_model, tokenizer):
    from gyre.checkpoint.store import verify_dir, write_model_dir

    out = write_model_dir(tmp_path / "final", make_tiny_model(), tokenizer, {"env": {"x": 1}})
    assert json.loads((out / "gyre_env.json").read_text()) == {"env": {"x": 1}}
    assert "gyre_env.json" in json.loads((out / "manifest.json").read_text())["files"]
    assert verify_dir(out) == []  # the record is covered by the manifest
