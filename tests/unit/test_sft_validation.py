"""``sft.validation_demos``: held-out demonstrations scored teacher-forced during SFT.

With a byte-level BPE Qwen2 (where a maze move and its newline are not one token each) and
with a tiny Qwen3-VL on the visual maze: the numbers logged are what their definition says,
computed independently from a plain forward, on demonstrations never trained on.
"""

from __future__ import annotations

import json

import pytest
import torch

from gyre import loop
from gyre.config import load_config
from gyre.models.build import load_pretrained
from gyre.models.vision import load_vlm, vision_of
from gyre.rollout.evaluate import EVAL_SEED_BASE, validation_seeds
from gyre.sft import demonstrations, run_sft, validation_demos
from gyre.trainer.batch import collate
from gyre.trainer.sft import sft_step, sft_validate
from gyre.trainer.stepwise import expand_steps
from helpers import save_qwen2_bpe
from vision_helpers import tiny_vlm


def _by_definition(model, batch) -> dict[str, float]:
    """Loss, token accuracy and exact rows from one plain forward of the whole batch."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    target = logp.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.loss_mask[:, 1:]
    known = (target > torch.log(torch.tensor(0.5))) & mask.bool()
    rows = mask.sum(1) > 0
    exact = (known.sum(1) == mask.sum(1)) & rows
    return {
        "sft/val_loss": float(-(target * mask).sum() / mask.sum()),
        "sft/val_token_acc": int(known.sum()) / int(mask.sum()),
        "sft/val_exact": int(exact.sum()) / int(rows.sum()),
    }


@pytest.mark.parametrize(("env", "at"), [
    (["env.name=maze", "rollout.history_turns=0"], [15, 30, 40]),  # one row a turn
    (["env.name=arithmetic", "env.arithmetic.max_operand=2", "env.arithmetic.ops=+",
      "sft.steps=150", "sft.validation_every=60", "sft.noise=0"], [60, 120, 150]),
], ids=["maze", "arithmetic"])  # fmt: skip
def test_sft_validation_with_a_bpe_model_is_logged_as_defined(tmp_path, env, at):
    base = save_qwen2_bpe(tmp_path / "base")
    cfg = load_config(None, [
        f"model.path={base}", f"run.dir={tmp_path / 'run'}", "log.console=off",
        "sft.steps=40", "sft.demos=40", "sft.batch_size=8",
        "sft.lr=0.01", "sft.lr_schedule=constant", "sft.warmup_steps=2",
        "sft.validation_demos=12", "sft.validation_every=15", *env,
    ])  # fmt: skip
    run_dir, device = loop.setup(cfg)
    out = run_sft(cfg, run_dir, device, loop.base_model_path(cfg, run_dir))
    logged = [json.loads(line) for line in (run_dir / "sft_metrics.jsonl").read_text().splitlines()]
    with_val = [r["step"] for r in logged if "sft/val_loss" in r]
    assert with_val == at  # every sft.validation_every steps and after the last

    model, tok = load_pretrained(out, device)
    demos = validation_demos(cfg, tok)
    assert [d.task_seed for d in demos] == validation_seeds(12)
    trained = {d.task_seed for d in demonstrations(cfg, run_dir, tok)}
    assert not trained & set(validation_seeds(12)) and max(trained) < EVAL_SEED_BASE
    rows, _ = expand_steps(demos)
    assert len(rows) == sum(d.num_turns for d in demos)  # the maze's: one row a turn
    assert all(sum(r.loss_mask) > 1 for r in rows)  # noise 0: every move is a target
    batch = collate(rows, tok.pad_token_id, device)
    want = _by_definition(model, batch)
    for size in (len(rows), 5):  # micro-batching does not change them
        got = sft_validate(model, batch, size)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert logged[-1]["sft/val_loss"] == pytest.approx(want["sft/val_loss"], rel=1e-5)
    assert logged[-1]["sft/val_exact"] == want["sft/val_exact"]
    first = next(r for r in logged if r["step"] == at[0])
    assert logged[-1]["sft/val_loss"] < first["sft/val_loss"]  # the demonstrator's moves, learnt


def test_sft_validation_of_a_vlm_is_sft_steps_loss_without_the_step(tmp_path):
    """On image turns the validation scores the same tokens the SFT step trains on: its loss
    on a batch is the loss the step reports before updating, and the model is left unchanged."""
    model, tok = load_vlm(tiny_vlm("qwen3_vl", tmp_path / "vlms"), torch.device("cpu"))
    cfg = load_config(None, ["env.name=visual_maze", "model.kind=qwen3_vl",
                             "rollout.history_turns=0", "sft.validation_demos=2"])  # fmt: skip
    demos = validation_demos(cfg, tok)
    assert all(d.images for d in demos)
    rows, _ = expand_steps(demos)
    batch = collate(rows, tok.pad_token_id, torch.device("cpu"), vision_of(tok))
    before = [p.detach().clone() for p in model.parameters()]
    val = sft_validate(model, batch, 4)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert 0.0 <= val["sft/val_exact"] <= val["sft/val_token_acc"] + 1e-9 <= 1.0 + 1e-9
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    step = sft_step(model, opt, batch, 4)
    assert val["sft/val_loss"] == pytest.approx(step["sft/loss"], rel=1e-5)
    assert val["sft/val_token_acc"] == pytest.approx(step["sft/token_acc"], rel=1e-6)
