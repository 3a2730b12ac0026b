"""Config loading: defaults, typed dotted overrides, YAML files and error messages."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gyre.config import (
    Config,
    ConfigError,
    describe_fields,
    dump_config,
    load_config,
    load_recipe,
    recipe_path,
)
from gyre.config.loading import default_config_path

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_load():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.env.name == "maze"
    assert cfg.run.resume == "never"
    assert isinstance(cfg.train.steps, int) and isinstance(cfg.train.lr, float)
    assert cfg.train.group_size >= 2
    assert cfg == load_config(None, [])


def test_dotted_overrides_are_typed():
    cfg = load_config(
        None,
        [
            "train.steps=3",
            "train.lr=5e-4",
            "train.sampling.temperature=0.5",
            "env.name=arithmetic",
            "run.dir=runs/x",
            "eval.sampled=false",
        ],
    )
    assert cfg.train.steps == 3 and type(cfg.train.steps) is int
    assert cfg.train.lr == 5e-4 and type(cfg.train.lr) is float
    assert cfg.train.sampling.temperature == 0.5
    assert cfg.env.name == "arithmetic"
    assert cfg.run.dir == "runs/x"
    assert cfg.eval.sampled is False


def test_later_override_wins():
    assert load_config(None, ["train.steps=3", "train.steps=4"]).train.steps == 4


@pytest.mark.parametrize("word", ["off", "plain", "rich", "auto"])
def test_log_console_words(word):
    assert load_config(None, [f"log.console={word}"]).log.console == word


@pytest.mark.parametrize(("word", "value"), [("off", False), ("no", False), ("on", True)])
def test_yaml11_words_still_work_for_bools(word, value):
    assert load_config(None, [f"eval.sampled={word}"]).eval.sampled is value


def test_unknown_key_named_with_value():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.stepz=3"])
    msg = str(info.value)
    assert "train.stepz" in msg and "3" in msg


def test_unknown_section_named():
    with pytest.raises(ConfigError, match="trian"):
        load_config(None, ["trian.steps=3"])


def test_bad_value_named():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.lr=abc"])
    msg = str(info.value)
    assert "train.lr" in msg and "abc" in msg


@pytest.mark.parametrize(
    ("item", "key"),
    [
        ("train.steps=-1", "train.steps"),
        ("train.group_size=1", "train.group_size"),
        ("train.sampling.top_p=1.5", "train.sampling.top_p"),
        ("env.name=chess", "env.name"),
        ("log.console=loud", "log.console"),
        ("env.maze.budget_factor=3", "env.maze.budget_factor"),
    ],
)
def test_range_and_choice_errors_name_the_key(item, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [item])


def test_override_must_have_equals():
    with pytest.raises(ConfigError, match=r"train\.steps"):
        load_config(None, ["train.steps"])


def test_override_into_a_leaf_is_an_error():
    with pytest.raises(ConfigError, match=r"train\.steps"):
        load_config(None, ["train.steps.x=1"])


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"env": {"name": "arithmetic"}, "train": {"steps": 7, "lr": 0.01}})
    )
    cfg = load_config(path)
    assert cfg.env.name == "arithmetic" and cfg.train.steps == 7 and cfg.train.lr == 0.01
    cfg = load_config(path, ["train.steps=9"])
    assert cfg.train.steps == 9 and cfg.train.lr == 0.01


def test_empty_yaml_is_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == load_config()


def test_yaml_unknown_key_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"train\.stepz"):
        load_config(path)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(missing) in str(info.value)


def test_invalid_yaml_and_non_mapping(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"list\.yaml"):
        load_config(listy)


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["train.steps=3", "env.name=arithmetic", "log.console=off"])
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_describe_fields_lists_every_leaf():
    lines = describe_fields()
    keys = {line.split(" = ")[0] for line in lines}
    assert {"train.steps", "train.sampling.top_p", "env.maze.size", "log.console"} <= keys
    assert all("#" in line for line in lines)


@pytest.mark.parametrize("name", ["maze", "arithmetic"])
def test_example_configs_load(name):
    path = ROOT / "examples" / name / "config.yaml"
    if not path.is_file():
        pytest.skip(f"{path} not written yet")
    cfg = load_config(path)
    assert cfg.env.name == name


@pytest.mark.parametrize(
    "path", sorted((ROOT / "examples").glob("*/*.yaml")), ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_every_example_config_validates(path):
    """A typo in an example (an unknown key, a bad value) fails here, not in a user's first run."""
    cfg = load_config(path)
    assert cfg.env.name


def test_maze_example_is_the_shipped_recipe():
    """`gyre train` and `gyre train examples/maze/config.yaml` run the same experiment: the
    example is the very file the package ships, and no code changes a value of it."""
    example = ROOT / "examples" / "maze" / "config.yaml"
    assert example.read_bytes() == recipe_path("maze").read_bytes()
    assert load_config(example) == load_recipe()
    assert default_config_path([]) == recipe_path("maze")
    assert default_config_path(["train.steps=3", "env.maze.size=6"]) == recipe_path("maze")
    assert default_config_path(["env.name=arithmetic"]) is None
    assert default_config_path(["model.path=some/folder"]) is None


def test_no_hidden_recipe_config_is_the_fields_defaults():
    """``Config()`` (and ``load_config(None)``) is the fields' own defaults whatever the env: the
    maze recipe's memoryless window and level replay come only from its file."""
    cfg = Config()
    assert cfg.env.name == "maze"
    assert cfg.rollout.history_turns is None and cfg.rollout.keep_opening
    assert cfg.train.level_replay.prob == 0.0
    assert load_config(None) == cfg
    recipe = load_recipe()
    assert recipe.rollout.history_turns == 0 and not recipe.rollout.keep_opening
    assert recipe.train.level_replay.prob == 0.5
    with pytest.raises(ConfigError, match="shipped: maze"):
        recipe_path("no_such_recipe")


def test_help_config_shows_the_recipe_values_and_the_field_defaults():
    lines = {line.split(" = ")[0]: line for line in describe_fields()}
    assert lines["rollout.history_turns"].startswith("rollout.history_turns = 0  #")
    assert lines["rollout.history_turns"].endswith("(field default: None)")
    assert lines["train.level_replay.prob"].startswith("train.level_replay.prob = 0.5  #")
    assert "field default" not in lines["train.steps"]  # the recipe's 150 is the field's too


def test_maze_long_differs_from_the_default_only_in_budget_and_selection():
    """examples/maze-long: the default's task and recipe, more GRPO steps, validation choice."""
    long = load_config(ROOT / "examples" / "maze-long" / "config.yaml")
    default = load_recipe()
    assert long.env == default.env and long.sft == default.sft
    assert long.train.steps > default.train.steps
    assert long.train.model_copy(update={"steps": default.train.steps}) == default.train
    assert long.eval.select == "val" and long.eval.validation_episodes > 0


def test_null_on_the_command_line_clears_any_nullable_key():
    """``key=null`` (or ``~``) sets a nullable key to null, as in YAML; a key that cannot be null
    still names itself in a one-line error, and a string key keeps other words as text."""
    lora = load_config(None, ["model.lora.rank=4"])
    assert lora.model.lora is not None and lora.model.lora.rank == 4
    cfg = load_config(None, [
        "train.algo.clip_eps_high=0.28", "train.algo.clip_eps_high=null", "train.algo.gamma=~",
        "rollout.history_turns=null",
    ])  # fmt: skip
    assert cfg.train.algo.clip_eps_high is None and cfg.train.algo.gamma is None
    assert cfg.rollout.history_turns is None
    with pytest.raises(ConfigError, match=r"^bad value for 'train.steps': 'null'"):
        load_config(None, ["train.steps=null"])
    assert load_config(None, ["run.dir=none"]).run.dir == "none"
