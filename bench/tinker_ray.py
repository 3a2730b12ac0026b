"""``gyre tinker-serve`` placement cost: ``runner=ray`` (the trainer and a sampler as Ray actors
on a local Ray) against ``runner=local`` (one process), through the official SDK.

Per round, on each server: a LoRA ``forward_backward`` + ``optim_step`` of B sequences of L
tokens (cross-entropy), waited for, and one ``sample`` of G sequences of exactly N new tokens
from the saved adapter. Rounds alternate the two servers so that background load hits both
alike; the medians and the ratio ray / local of the wall times are printed. Both servers run
in this process (the Ray one's work in its actors), every process with one torch thread.

Run::

    RAY_AUTH_MODE=disabled OMP_NUM_THREADS=1 python bench/tinker_ray.py
    RAY_AUTH_MODE=disabled python bench/tinker_ray.py --model-path /models/smollm2 --rounds 3

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
from tinker_helpers import bench_args, random_sl_data, start_in_process


def _round(tc, sampler, data, prompt, args, seed: int) -> tuple[float, float]:
    """(train seconds, sample seconds) of one round on one server."""
    from tinker import types

    t = time.perf_counter()
    fb = tc.forward_backward(data, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    fb.result()
    train_s = time.perf_counter() - t
    t = time.perf_counter()
    params = types.SamplingParams(max_tokens=args.new_tokens, stop=[], seed=seed)
    res = sampler.sample(prompt, num_samples=args.samples, sampling_params=params).result()
    assert sum(len(s.tokens) for s in res.sequences) == args.samples * args.new_tokens
    return train_s, time.perf_counter() - t


def main() -> None:
    args = bench_args(__doc__)
    torch.set_num_threads(1)
    import tinker
    from tinker import types

    ray_keys = {"address": "local", "num_cpus": 2, "trainer": {"num_cpus": 1}}
    servers = {
        "local": start_in_process(Path(tempfile.mkdtemp()), model_path=args.model_path),
        "ray": start_in_process(
            Path(tempfile.mkdtemp()), model_path=args.model_path, runner="ray", ray=ray_keys
        ),
    }
    g = torch.Generator().manual_seed(0)
    clients = {}
    for name, served in servers.items():
        sc = tinker.ServiceClient(base_url=served.url, api_key="tml-bench")
        tc = sc.create_lora_training_client(base_model=served.service.host.name, rank=8).result()
        clients[name] = (tc, tc.save_weights_and_get_sampling_client().result())
    vocab = servers["local"].service.host.vocab
    _, data = random_sl_data(vocab, args.batch, args.length, g)
    prompt_ids = torch.randint(3, vocab, (args.prompt,), generator=g).tolist()
    prompt = types.ModelInput.from_ints(prompt_ids)
    rows: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for name in ("local", "ray") if r % 2 == 0 else ("ray", "local"):
            train_s, sample_s = _round(*clients[name], data, prompt, args, seed=r)
            rows.setdefault(f"{name}_train_s", []).append(train_s)
            rows.setdefault(f"{name}_sample_s", []).append(sample_s)
    for served in servers.values():
        served.stop()
    med = {k: statistics.median(v) for k, v in rows.items()}
    report = {
        "bench": "tinker_ray",
        "model": args.model_path or "tiny",
        "median_s": med,
        "ratio_ray_over_local": {
            "forward_backward+optim_step": med["ray_train_s"] / med["local_train_s"],
            "sample": med["ray_sample_s"] / med["local_sample_s"],
        },
        "shape": vars(args),
    }
    for kind in ("train", "sample"):
        loc, ray_ = med[f"local_{kind}_s"], med[f"ray_{kind}_s"]
        print(
            f"{kind:6s} local {loc * 1e3:8.1f} ms  ray {ray_ * 1e3:8.1f} ms  ratio {ray_ / loc:.2f}"
        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
