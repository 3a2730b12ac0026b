"""Did the update move the recorded replies the way their rewards say? The mean summed
log-prob of the sampled tokens of rewarded and of zero-reward recorded episodes, under the
served model and under the trained one (GRPO should raise the first relative to the second).

    python examples/agent-proxy/check_update.py runs/agent-rec runs/agent-model \
        runs/agent-train/final
"""

from __future__ import annotations

import sys

import torch

from gyre.models.build import load_pretrained
from gyre.rollout.recorded import read_records, to_trajectory
from gyre.trainer.batch import collate, token_logprobs


def mean_logprob(model_dir: str, records: list[dict]) -> float:
    model, tok = load_pretrained(model_dir, torch.device("cpu"))
    total = 0.0
    for r in records:
        t = to_trajectory(r, 0, "0")
        with torch.no_grad():
            lp, _ = token_logprobs(model, collate([t], tok.pad_token_id, torch.device("cpu")))
        total += float(lp[0][torch.tensor(t.loss_mask, dtype=torch.bool)].sum())
    return total / max(len(records), 1)


def main(argv: list[str]) -> int:
    rec, base, trained = argv
    torch.set_num_threads(1)
    records = read_records(rec, 1 << 31, 1.0, 1.0)
    for name, sel in (
        ("rewarded", [r for r in records if r["reward"] > 0]),
        ("zero reward", [r for r in records if r["reward"] == 0]),
    ):
        a, b = mean_logprob(base, sel), mean_logprob(trained, sel)
        print(f"{name:12s} n={len(sel):4d}  sampled-token logprob per episode: served {a:8.3f}  "
              f"trained {b:8.3f}  change {b - a:+.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
