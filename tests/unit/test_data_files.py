"""env.name=dataset in the ecosystem's formats: JSONL (gyre's reader), JSON, Parquet and Arrow
(Hugging Face datasets), the column mapping, and one-line errors naming the column and file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre.config import ConfigError, EnvConfig, load_config
from gyre.envs import env_factory
from gyre.envs.data_files import file_format, load_tasks
from gyre.errors import InputError

datasets = pytest.importorskip("datasets", reason="the datasets extra is not installed")

ROWS = [
    {"question": "2+3=", "solution": 5, "level": "easy"},
    {"question": "7-4=", "solution": "3", "level": "easy"},
    {"question": "6*7=", "solution": 42, "level": "hard"},
]


def _write_all(tmp_path: Path, rows: list[dict]) -> dict[str, Path]:
    """The same rows as JSONL, JSON (array), Parquet, an Arrow file and a save_to_disk folder."""
    out = {"jsonl": tmp_path / "t.jsonl", "json": tmp_path / "t.json"}
    out["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    out["json"].write_text(json.dumps(rows))
    # one column type for the Arrow formats (Parquet / Arrow columns are typed)
    ds = datasets.Dataset.from_list([{**r, "solution": str(r["solution"])} for r in rows])
    out["parquet"] = tmp_path / "t.parquet"
    ds.to_parquet(str(out["parquet"]))
    out["folder"] = tmp_path / "saved"
    ds.save_to_disk(str(out["folder"]))
    out["arrow"] = next(out["folder"].glob("*.arrow"))
    return out


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "arrow", "folder"])
def test_round_trip_with_column_mapping(tmp_path: Path, kind: str) -> None:
    path = _write_all(tmp_path, ROWS)[kind]
    tasks = load_tasks(path, "auto", "question", "solution")
    assert [t.prompt for t in tasks] == ["2+3=", "7-4=", "6*7="]
    assert [t.answer for t in tasks] == ["5", "3", "42"]
    assert tasks[2].meta == {"solution": "42", "level": "hard"}  # other columns are metadata


@pytest.mark.parametrize("kind", ["parquet", "arrow", "folder"])
def test_env_factory_trains_and_holds_out_rows(tmp_path: Path, kind: str) -> None:
    path = _write_all(tmp_path, ROWS)[kind]
    cfg = EnvConfig.model_validate(
        {
            "name": "dataset",
            "dataset": {
                "path": str(path),
                "prompt_field": "question",
                "answer_field": "solution",
                "eval_rows": 1,
            },
        }
    )
    env = env_factory(cfg)()
    assert env.reset(2**31) == "6*7="  # the held-out (last) row
    _, reward, done, info = env.step("42")
    assert (reward, done, info["task"]["level"]) == (1.0, True, "hard")
    assert {env.reset(s) for s in range(10)} == {"2+3=", "7-4="}


def test_format_key_overrides_the_extension(tmp_path: Path) -> None:
    src = _write_all(tmp_path, ROWS)["parquet"]
    odd = tmp_path / "tasks.data"
    odd.write_bytes(src.read_bytes())
    with pytest.raises(InputError, match=r"cannot tell the format.*'\.data'.*env.dataset.format"):
        load_tasks(odd, "auto", "question", "solution")
    assert len(load_tasks(odd, "parquet", "question", "solution")) == 3
    assert file_format(tmp_path / "x.JSONL") == "jsonl"
    json_path = _write_all(tmp_path, ROWS)["json"]
    renamed = tmp_path / "rows.txt"
    renamed.write_text(json_path.read_text())
    cfg = load_config(None, ["env.name=dataset", "env.dataset.format=json"]).env.dataset
    assert len(load_tasks(renamed, cfg.format, "question", "solution")) == 3


@pytest.mark.parametrize("kind", ["json", "parquet", "arrow", "folder"])
def test_missing_column_is_one_line_naming_column_and_file(tmp_path: Path, kind: str) -> None:
    path = _write_all(tmp_path, ROWS)[kind]
    with pytest.raises(InputError) as exc:
        load_tasks(path, "auto", "prompt", "solution")
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg and "no column 'prompt'" in msg
    assert "env.dataset.prompt_field" in msg and "question" in msg  # lists the columns


def test_jsonl_keeps_file_line_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"question": "1+1=", "solution": 2}\n{"question": "x"}\n')
    with pytest.raises(InputError, match=rf"{path}:2: missing field 'solution'"):
        load_tasks(path, "auto", "question", "solution")


def test_bad_row_names_the_file_and_row(tmp_path: Path) -> None:
    rows = [{"question": "a", "solution": "1"}, {"question": "", "solution": "2"}]
    path = tmp_path / "t.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    with pytest.raises(InputError, match=rf"{path}\[row 1\]: field 'question' must be a non-empty"):
        load_tasks(path, "auto", "question", "solution")


def test_unreadable_and_missing_files(tmp_path: Path) -> None:
    bad = tmp_path / "t.parquet"
    bad.write_text("this is not parquet")
    with pytest.raises(InputError) as exc:
        load_tasks(bad, "auto", "question", "solution")
    assert str(bad) in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(InputError, match="does not exist"):
        load_tasks(tmp_path / "none.parquet")
    empty = tmp_path / "e.parquet"
    datasets.Dataset.from_dict({"prompt": [], "answer": []}).to_parquet(str(empty))
    with pytest.raises(InputError, match=r"e\.parquet: not a readable parquet dataset"):
        load_tasks(empty)  # datasets refuses an empty Parquet file itself ("no data")
    empty_arrow = tmp_path / "empty"
    datasets.Dataset.from_dict({"prompt": [], "answer": []}).save_to_disk(str(empty_arrow))
    with pytest.raises(InputError, match=rf"{empty_arrow}(: not a readable| holds no rows)"):
        load_tasks(empty_arrow)


def test_config_refuses_an_unknown_format() -> None:
    with pytest.raises(ConfigError, match=r"env\.dataset\.format"):
        load_config(None, ["env.name=dataset", "env.dataset.format=csv"])


@pytest.mark.parametrize(
    ("module", "cfg", "message"),
    [
        ("gymnasium", {"name": "gymnasium"}, "pip install 'gyre[gymnasium]'"),
        ("reasoning_gym", {"name": "reasoning_gym"}, "pip install 'gyre[reasoning-gym]'"),
        (
            "datasets",
            {"name": "dataset", "dataset": {"path": "PATH"}},
            "env.dataset.format=parquet needs the Hugging Face datasets package: "
            "pip install 'gyre[datasets]'",
        ),
    ],
)
def test_a_missing_extra_is_one_line(tmp_path: Path, monkeypatch, module, cfg, message) -> None:
    path = _write_all(tmp_path, ROWS)["parquet"]
    if "dataset" in cfg:
        cfg = {**cfg, "dataset": {"path": str(path)}}
    monkeypatch.setitem(__import__("sys").modules, module, None)  # import now raises
    with pytest.raises(InputError) as exc:
        env_factory(EnvConfig.model_validate(cfg))
    assert message in str(exc.value) and "\n" not in str(exc.value)
