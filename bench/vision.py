"""What images cost: the tiny Qwen2.5-VL against a text model with the same language model.

Both sides play the same multi-turn message-mode task -- "which colour is the square?", one
user turn per episode turn -- through ``gyre.rollout.episodes.run_episodes`` and the
``TorchEngine``, then score the batch with the trainer's ``token_logprobs`` and backpropagate
(the bulk of a GRPO step). The VLM sees each turn's square as an image (``model.kind=
qwen2_5_vl``: 16 image tokens per 64x64 image, a 2-layer vision tower); the text side is a
``Qwen2ForCausalLM`` with the VLM's language-model dimensions and tokenizer, and reads the
colour as a word. So the difference is the vision tower, the placeholder tokens, and the
Hugging Face forward the VLM takes (the text model gets gyre's lean forward and packed scoring).

Timing: each side warmed up once, then timed ``--repeats`` times interleaved; the best run is
reported (other load only slows a run), with the median.

    python bench/vision.py --tasks 8 --group 4 --turns 2 --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from gyre.engines.torch_engine import TorchEngine  # noqa: E402
from gyre.models.vision import load_vlm, vision_of  # noqa: E402
from gyre.models.vision_build import create_tiny_vlm  # noqa: E402
from gyre.rollout.chat import ChatMode, ChatTemplate  # noqa: E402
from gyre.rollout.episodes import RolloutStats, run_episodes  # noqa: E402
from gyre.trainer.batch import collate, token_logprobs  # noqa: E402
from gyre.types import SamplingParams  # noqa: E402
from vision_helpers import COLOURS, ColourEnv  # noqa: E402


class TextColourEnv(ColourEnv):
    """ColourEnv with the colour written instead of drawn."""

    def reset(self, seed: int) -> list[dict[str, Any]]:
        super().reset(seed)
        return [{"role": "user", "content": f"The square is {self.colour}. Which colour?"}]

    def step(self, action: str):  # type: ignore[override]
        msgs, r, done, info = super().step(action)
        if msgs:
            msgs = [{"role": "user", "content": f"No. The square is {self.colour}."}]
        return msgs, r, done, info


def _text_twin(vlm: torch.nn.Module) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    t = vlm.config.text_config
    cfg = Qwen2Config(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, max_position_embeddings=4096,
        tie_word_embeddings=True, pad_token_id=t.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


def _once(model, tok, env_cls, args, seed: int) -> tuple[float, float, int]:
    """(rollout seconds, score+backward seconds, generated tokens) of one batch."""
    tpl = ChatTemplate(tok)
    engine = TorchEngine(model, tok.pad_token_id, vision=vision_of(tok))
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens,
                            stop_token_ids=tpl.stop_ids(), seed=seed)  # fmt: skip
    stats = RolloutStats()
    t0 = time.perf_counter()
    trajs = run_episodes(lambda: env_cls(turns=args.turns, size=64), engine, tok,
                         list(range(args.tasks)), args.group, params, stats,
                         chat=ChatMode(tpl))  # fmt: skip
    t1 = time.perf_counter()
    model.train()
    batch = collate(trajs, tok.pad_token_id, torch.device("cpu"), vision_of(tok))
    lp, _ = token_logprobs(model, batch, 1.0, 1.0, score_mask=batch.loss_mask)
    (-(lp * batch.loss_mask).sum()).backward()
    model.zero_grad(set_to_none=True)
    model.eval()
    return t1 - t0, time.perf_counter() - t1, stats.generated_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert len(COLOURS) == 4
    with tempfile.TemporaryDirectory() as d:
        folder = create_tiny_vlm("qwen2_5_vl", Path(d) / "vlm", seed=0)
        vlm, tok = load_vlm(folder, torch.device("cpu"))
    plain_tok = copy.copy(tok)  # the same vocabulary and template, without the vision side
    plain_tok.__dict__.pop("_gyre_vision", None)
    assert vision_of(plain_tok) is None
    text = _text_twin(vlm.eval()).eval()
    sides = {
        "tiny VLM (images)": (vlm, tok, ColourEnv),
        "text twin": (text, plain_tok, TextColourEnv),
    }
    runs: dict[str, list[tuple[float, float, int]]] = {k: [] for k in sides}
    for r in range(args.repeats + 1):
        for name, (m, t, env) in sides.items():
            res = _once(m, t, env, args, seed=r)
            if r:  # the first round warms up
                runs[name].append(res)
    print(f"{args.tasks} tasks x {args.group} samples, {args.turns} turns, "
          f"{args.threads} thread(s); best (median) of {args.repeats}")  # fmt: skip
    print(f"{'side':20s} {'rollout tok/s':>22s} {'score+backward s':>22s} {'tokens':>7s}")
    for name, rs in runs.items():
        tps = [n / a for a, _, n in rs]
        sb = [b for _, b, _ in rs]
        n = int(np.mean([n for *_, n in rs]))
        print(f"{name:20s} {max(tps):10.0f} ({statistics.median(tps):7.0f}) "
              f"{min(sb):12.3f} ({statistics.median(sb):6.3f}) {n:7d}")  # fmt: skip


if __name__ == "__main__":
    main()
