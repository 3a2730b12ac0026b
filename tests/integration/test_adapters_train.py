"""The env adapters and the custom-env example through ``gyre train`` / ``gyre eval``: short
runs on the tiny model (fast), and learning runs (``@pytest.mark.slow``, figures in
docs/envs.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from gyre.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.intermediate_size=64",
    "sft.steps=2",
    "sft.demos=8",
    "sft.batch_size=4",
    "train.steps=2",
    "train.tasks_per_step=2",
    "train.group_size=2",
    "eval.episodes=4",
    "eval.every=0",
    "checkpoint.every=0",
    "log.console=off",
    "run.threads=1",
]


def _train_records(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return [r for r in rows if "train/loss" in r]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# -- the custom-env example (docs/envs.md, "Write your own env in 30 lines") -----------------


def test_docs_code_block_is_the_example_file() -> None:
    docs = (ROOT / "docs" / "envs.md").read_text()
    section = docs.split("## Write your own env in 30 lines", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert blocks, "no python block in the section"
    assert blocks[0] == (ROOT / "examples" / "custom-env" / "envs.py").read_text()
    assert (
        f"```yaml\n{(ROOT / 'examples' / 'custom-env' / 'config.yaml').read_text()}```" in section
    )


def test_custom_env_expert_always_wins() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "custom_envs", ROOT / "examples/custom-env/envs.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    env, rng = mod.HigherLower(), np.random.default_rng(0)
    for seed in range(40):
        env.reset(seed)
        done = False
        while not done:
            _, reward, done, info = env.step(env.expert_action(rng))
        assert info["success"] and reward == 1.0
    env.reset(0)
    for reply in ("seven", "²"):  # unparsable: a wasted turn
        obs, _, done, info = env.step(reply)
        assert obs in ("higher:", "lower:") and not done and info["state"] == (0, 15)


def test_custom_env_example_trains(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = str(ROOT / "examples" / "custom-env" / "config.yaml")
    assert main(["train", cfg, *TINY, f"run.dir={run_dir}"]) == 0
    assert [r["step"] for r in _train_records(run_dir)] == [1, 2]
    assert "custom-env/envs.py:HigherLower" in (run_dir / "config.yaml").read_text()


# -- the adapters, two steps each, then gyre eval on the final model ----------------------------


def test_gymnasium_frozen_lake_train_then_eval(tmp_path: Path) -> None:
    pytest.importorskip("gymnasium", reason="the gymnasium extra is not installed")
    run_dir = tmp_path / "run"
    cfg = str(ROOT / "examples" / "frozenlake" / "config.yaml")
    extra = ["train.algo.advantage=gigpo", "env.gymnasium.max_steps=4"]
    assert main(["train", cfg, *TINY, f"run.dir={run_dir}", *extra]) == 0
    train = _train_records(run_dir)
    assert [r["step"] for r in train] == [1, 2] and train[0]["rollout/turns_mean"] > 1
    eval_dir = tmp_path / "eval"
    # the env comes from final/gyre_env.json (what the model was trained on)
    assert main(["eval", f"model.path={run_dir}/final", f"run.dir={eval_dir}", *TINY[-3:]]) == 0
    res = json.loads((eval_dir / "eval.json").read_text())
    assert 0.0 <= res["eval/success_greedy"] <= 1.0 and res["eval/moves_greedy"] > 1


def test_reasoning_gym_train(tmp_path: Path) -> None:
    pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra is not installed")
    run_dir = tmp_path / "run"
    cfg = str(ROOT / "examples" / "reasoning-gym" / "config.yaml")
    assert main(["train", cfg, *TINY, f"run.dir={run_dir}"]) == 0
    train = _train_records(run_dir)
    assert [r["step"] for r in train] == [1, 2] and train[0]["rollout/turns_mean"] == 1.0


def test_parquet_dataset_train(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="the datasets extra is not installed")
    rows = [
        {"q": f"{a}+{b}=", "a": str(a + b), "level": "easy"} for a in range(5) for b in range(5)
    ]
    path = tmp_path / "tasks.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    run_dir = tmp_path / "run"
    extra = [
        "env.name=dataset",
        f"env.dataset.path={path}",
        "env.dataset.prompt_field=q",
        "env.dataset.answer_field=a",
        "env.dataset.eval_rows=5",
    ]
    assert main(["train", *TINY, *extra, f"run.dir={run_dir}"]) == 0
    assert [r["step"] for r in _train_records(run_dir)] == [1, 2]


def test_missing_column_stops_gyre_train_in_one_line(tmp_path: Path, capsys) -> None:
    datasets = pytest.importorskip("datasets", reason="the datasets extra is not installed")
    path = tmp_path / "tasks.parquet"
    datasets.Dataset.from_list([{"q": "1+1=", "a": "2"}]).to_parquet(str(path))
    rc = main(
        ["train", *TINY, "env.name=dataset", f"env.dataset.path={path}", f"run.dir={tmp_path}/r"]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert f"{path}: no column 'prompt' (env.dataset.prompt_field)" in err


# -- learning runs (GYRE_SLOW=1) ------------------------------------------------------------------


def _eval_before_after(run_dir: Path) -> tuple[float, float]:
    s = _summary(run_dir)
    return s["before"]["eval/success_greedy"], s["after"]["eval/success_greedy"]


LEARN = ["log.console=off", "run.threads=1", "checkpoint.every=0", "eval.every=0"]


@pytest.mark.slow
def test_grpo_raises_frozen_lake_success(tmp_path: Path) -> None:
    """examples/frozenlake/config.yaml as it is: FrozenLake-v1 4x4, not slippery, a random map
    per seed (held-out seeds are unseen maps); SFT on the BFS expert, then GRPO (figures:
    docs/envs.md)."""
    pytest.importorskip("gymnasium", reason="the gymnasium extra is not installed")
    run_dir = tmp_path / "run"
    cfg = str(ROOT / "examples" / "frozenlake" / "config.yaml")
    assert main(["train", cfg, *LEARN, f"run.dir={run_dir}"]) == 0
    before, after = _eval_before_after(run_dir)
    assert after > before + 0.1, (before, after)


@pytest.mark.slow
@pytest.mark.parametrize(
    "example,success_rises",
    [("spell-backward", True), ("letter-jumble", False)],
    ids=["spell_backward", "letter_jumble"],
)
def test_grpo_raises_the_held_out_reasoning_gym_score(
    tmp_path: Path, example: str, success_rises: bool
) -> None:
    """examples/reasoning-gym/<example>.yaml as it is: SFT stopped early, then GRPO, on held-out
    questions that are never training questions; the dataset's own (partial-credit) score rises,
    and for spell_backward the greedy success too (figures, three seeds each: docs/envs.md).
    letter-jumble takes about 17 minutes on one thread, spell-backward about 2."""
    pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra is not installed")
    run_dir = tmp_path / "run"
    cfg = str(ROOT / "examples" / "reasoning-gym" / f"{example}.yaml")
    assert main(["train", cfg, *LEARN, f"run.dir={run_dir}"]) == 0
    s = _summary(run_dir)
    before, after = s["before"], s["after"]
    assert after["eval/reward_greedy"] > before["eval/reward_greedy"] + 0.03, (before, after)
    if success_rises:
        assert after["eval/success_greedy"] > before["eval/success_greedy"], (before, after)


# -- with a byte-level BPE tokenizer and a real chat template (as a user's model would be) -----


@pytest.mark.parametrize(
    "extra",
    [
        # reasoning-gym in message mode: the prompt goes through ChatML, the reply through the tag
        [
            "env.name=reasoning_gym",
            "env.reasoning_gym.messages=true",
            "env.reasoning_gym.size=20",
            "env.reasoning_gym.eval_size=10",
            "env.reasoning_gym.prompt_template=Answer in <answer></answer>. {question}",
        ],
        # gymnasium in raw text with the BPE tokenizer (the newline is not one token there)
        [
            "env.name=gymnasium",
            "env.gymnasium.make_kwargs={is_slippery: false}",
            "env.gymnasium.max_steps=3",
        ],
    ],
    ids=["reasoning_gym_chat", "gymnasium_bpe"],
)
def test_adapters_with_a_chat_tokenizer(tmp_path: Path, extra: list[str]) -> None:
    pytest.importorskip("gymnasium" if "gymnasium" in extra[0] else "reasoning_gym")
    from chat_helpers import build_chat_model, build_chat_tokenizer

    tok = build_chat_tokenizer("chatml")
    build_chat_model(tok, "qwen2", seed=0).save_pretrained(tmp_path / "init")
    tok.save_pretrained(tmp_path / "init")
    run_dir = tmp_path / "run"
    args = [f"model.path={tmp_path / 'init'}", f"run.dir={run_dir}", "sft.steps=0"]
    args += ["train.sampling.max_new_tokens=8", *TINY[6:], *extra]
    assert main(["train", *args]) == 0
    train = _train_records(run_dir)
    assert [r["step"] for r in train] == [1, 2]
    if "env.reasoning_gym.messages=true" in extra:
        assert train[0]["rollout/template_drift"] == 0.0  # ChatML is prefix-stable


def test_conversational_dataset_sft_then_grpo_with_a_chat_tokenizer(tmp_path: Path) -> None:
    """A TRL-style conversational Parquet dataset (system + user messages, a `solution`
    column): message-mode SFT on its answers, then GRPO, through ChatML and a byte-level BPE."""
    datasets = pytest.importorskip("datasets", reason="the datasets extra is not installed")
    from chat_helpers import build_chat_model, build_chat_tokenizer

    rows = [
        {"prompt": [{"role": "system", "content": "Answer with the number."},
                    {"role": "user", "content": f"{a} plus {b}?"}], "solution": str(a + b)}
        for a in range(4) for b in range(4)
    ]  # fmt: skip
    path = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    tok = build_chat_tokenizer("chatml")
    build_chat_model(tok, "qwen2", seed=0).save_pretrained(tmp_path / "init")
    tok.save_pretrained(tmp_path / "init")
    run_dir = tmp_path / "run"
    args = [f"model.path={tmp_path / 'init'}", f"run.dir={run_dir}", "env.name=dataset"]
    args += [f"env.dataset.path={path}", "env.dataset.answer_field=solution"]
    args += ["env.dataset.eval_rows=4", "train.sampling.max_new_tokens=6", *TINY[3:]]
    assert main(["train", *args]) == 0
    train = _train_records(run_dir)
    assert [r["step"] for r in train] == [1, 2]
    assert train[0]["rollout/template_drift"] == 0.0
    sft = [json.loads(x) for x in (run_dir / "sft_metrics.jsonl").read_text().splitlines()]
    assert len(sft) == 2 and all(np.isfinite(r["sft/loss"]) for r in sft)
    demo = torch.load(run_dir / "sft_demos.pt", weights_only=False)["value"][0]
    text = tok.decode(demo.token_ids)  # rendered by the template, the answer in the turn
    assert text.startswith("<|im_start|>system\nAnswer with the number.<|im_end|>\n")
    answer = tok.decode([t for t, m in zip(demo.token_ids, demo.loss_mask, strict=True) if m])
    assert answer.endswith("<|im_end|>") and answer[: -len("<|im_end|>")] in {
        str(r["solution"]) for r in rows
    }
