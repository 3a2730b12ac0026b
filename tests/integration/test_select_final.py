"""eval.select=val: final/ holds the weights of the evaluation with the best validation success,
chosen without looking at the held-out results; the summary and the console table say which."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from gyre.cli import main
from gyre.config import ConfigError, load_config

TINY = [
    "model.hidden_size=32", "model.num_layers=2", "model.intermediate_size=64",
    "sft.steps=4", "sft.demos=8", "sft.batch_size=4", "checkpoint.sft_every=0",
    "train.steps=4", "train.tasks_per_step=2", "train.group_size=4", "train.lr=0.05",
    "eval.episodes=6", "eval.validation_episodes=6", "eval.every=1", "eval.select=val",
    "eval.sampled=false", "log.console=off", "run.threads=1", "checkpoint.every=0",
    "env.name=arithmetic", "env.arithmetic.max_operand=3", "env.arithmetic.ops=+",
]  # fmt: skip


def _weights(folder: Path) -> dict:
    return load_file(str(folder / "model.safetensors"))


def test_final_is_the_best_validation_evaluation(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert main(["train", *TINY, f"run.dir={run}", "log.console=plain"]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val/success_greedy" in r]
    assert [r["step"] for r in evals] == [0, 1, 2, 3, 4]
    best = max(evals, key=lambda r: r["val/success_greedy"])  # max() keeps the first maximum
    summary = json.loads((run / "summary.json").read_text())
    assert summary["selected"]["step"] == best["step"]
    assert summary["selected"]["val"] == best["val/success_greedy"]
    assert summary["after"]["eval/success_greedy"] == best["eval/success_greedy"]
    assert summary["last"]["eval/success_greedy"] == evals[-1]["eval/success_greedy"]
    assert _weights(run / "final").keys() == _weights(run / "best").keys()
    for k, v in _weights(run / "best").items():
        assert v.equal(_weights(run / "final")[k])
    assert summary["demonstrator"]["eval/success_greedy"] == 1.0  # arithmetic's expert is exact
    assert "demonstrator" in capsys.readouterr().out


def test_select_val_needs_validation_episodes() -> None:
    with pytest.raises(ConfigError, match=r"eval\.validation_episodes"):
        load_config(None, ["eval.select=val"])


def test_keep_best_keeps_the_first_maximum(tmp_path: Path) -> None:
    from gyre.loop import _keep_best, _select_final

    cfg = load_config(None, ["eval.select=val", "eval.validation_episodes=4", "train.steps=3"])
    written: list[Path] = []

    class Placement:
        def write_final(self, out: Path) -> None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "which").write_text(str(len(written)))
            written.append(out)

    state: dict = {"best": None}
    p = Placement()
    for step, val, held in [(0, 0.5, 0.9), (1, 0.75, 0.1), (2, 0.75, 1.0), (3, 0.25, 1.0)]:
        _keep_best(cfg, p, state, step, {"val/success_greedy": val, "eval/success_greedy": held},
                   tmp_path)  # fmt: skip
    assert state["best"] == {"step": 1, "val": 0.75, "eval": {"eval/success_greedy": 0.1}}
    assert len(written) == 2  # steps 0 and 1 improved; a tie or a drop writes nothing
    (tmp_path / "final").mkdir()
    assert _select_final(cfg, state, tmp_path)["step"] == 1
    assert (tmp_path / "final" / "which").read_text() == "1"
