"""Tinker API overhead: ``forward_backward`` and ``sample`` through the official SDK and
``gyre tinker-serve``, against gyre's own in-process training step and engine on the same model.

1. Training: B random sequences of L tokens, cross-entropy on every token, then an AdamW step
   (LoRA rank 8 on attention + MLP, lr 1e-4). SDK side: ``forward_backward`` + ``optim_step``
   and wait for both. gyre side: ``collate`` -> ``token_logprobs`` -> summed NLL -> backward
   -> ``AdamW.step`` on a peft LoRA of the same base. Trained tokens per second.
2. Sampling: one prompt of P tokens, G samples of exactly N new tokens (no stop), temperature 1.
   SDK side: ``SamplingClient.sample`` on the base model. gyre side: ``TorchEngine.generate``.
   Generated tokens per second.

Both sides run in this process with one torch thread (the server in a thread, so neither side
gets more cores); rounds are interleaved so background load hits both alike, and the median of
R rounds is reported with the ratio SDK / gyre.

Run::

    python bench/tinker_throughput.py                         # the tiny model
    python bench/tinker_throughput.py --model-path /models/smollm2 --rounds 3

The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gyre.config import LoraConfig
from gyre.engines import TorchEngine
from gyre.models.build import load_pretrained
from gyre.models.lora import apply_lora
from gyre.trainer.batch import collate, token_logprobs
from gyre.types import GenerationRequest, SamplingParams, Trajectory
from tinker_helpers import bench_args, random_sl_data, start_in_process

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _gyre_train_step(model, opt, seqs: list[list[int]], pad: int) -> None:
    trajs = [
        Trajectory(s, [0] + [1] * (len(s) - 1), [0.0] * len(s), 0.0, i, 0, 1, False, i)
        for i, s in enumerate(seqs)
    ]
    batch = collate(trajs, pad, torch.device("cpu"))
    lp, _ = token_logprobs(model, batch)
    (-(lp * batch.loss_mask).sum()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    args = bench_args(__doc__)
    torch.set_num_threads(1)
    import tinker
    from tinker import types

    state = Path(tempfile.mkdtemp(prefix="tinker-bench-"))
    local = start_in_process(state, model_path=args.model_path)
    path = local.service.host.path
    sc = tinker.ServiceClient(base_url=local.url, api_key="tml-bench")
    name = local.service.host.name
    tc = sc.create_lora_training_client(base_model=name, rank=8, train_unembed=False).result()
    sampler = sc.create_sampling_client(base_model=name).result()

    model, tok = load_pretrained(path, torch.device("cpu"))
    lora = apply_lora(model, LoraConfig(rank=8, alpha=32, target_modules=TARGETS))
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-4)
    engine = TorchEngine(load_pretrained(path, torch.device("cpu"))[0], tok.pad_token_id or 0)
    vocab = len(tok)
    g = torch.Generator().manual_seed(0)
    seqs, data = random_sl_data(vocab, args.batch, args.length, g)
    prompt = torch.randint(3, vocab, (args.prompt,), generator=g).tolist()
    n, gsz = args.new_tokens, args.samples
    rows: dict[str, list[float]] = {
        k: [] for k in ("sdk_train", "gyre_train", "sdk_sample", "gyre_sample")
    }
    trained = args.batch * (args.length - 1)
    for r in range(args.rounds):
        t = time.perf_counter()
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        fb.result()
        rows["sdk_train"].append(trained / (time.perf_counter() - t))
        t = time.perf_counter()
        _gyre_train_step(lora, opt, seqs, tok.pad_token_id or 0)
        rows["gyre_train"].append(trained / (time.perf_counter() - t))
        t = time.perf_counter()
        res = sampler.sample(
            types.ModelInput.from_ints(prompt),
            num_samples=gsz,
            sampling_params=types.SamplingParams(max_tokens=n, stop=[], seed=r),
        ).result()
        got = sum(len(s.tokens) for s in res.sequences)
        rows["sdk_sample"].append(got / (time.perf_counter() - t))
        t = time.perf_counter()
        reqs = [GenerationRequest(list(prompt), seed=r * 100 + i) for i in range(gsz)]
        outs = engine.generate(reqs, SamplingParams(max_new_tokens=n))
        rows["gyre_sample"].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
    med = {k: statistics.median(v) for k, v in rows.items()}
    report = {
        "bench": "tinker_throughput",
        "model": name,
        "train_tok_s": {
            "sdk": med["sdk_train"],
            "gyre": med["gyre_train"],
            "ratio_sdk_over_gyre": med["sdk_train"] / med["gyre_train"],
        },
        "sample_tok_s": {
            "sdk": med["sdk_sample"],
            "gyre": med["gyre_sample"],
            "ratio_sdk_over_gyre": med["sdk_sample"] / med["gyre_sample"],
        },
        "shape": vars(args),
    }
    for k in ("train_tok_s", "sample_tok_s"):
        v = report[k]
        print(
            f"{k}: SDK {v['sdk']:.0f}  gyre {v['gyre']:.0f}  ratio {v['ratio_sdk_over_gyre']:.2f}"
        )
    sc.close("success").result()
    local.stop()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
