"""HTTP engine overhead and weight-sync cost, side by side.

1. Throughput: the same GRPO-style batch (P prompts x G samples, exactly N new tokens each, no
   stop token, temperature 1) through the in-process ``TorchEngine`` and through ``HttpEngine``
   -> ``gyre serve`` (a child process on 127.0.0.1 running the same model, 1 torch thread on
   both sides). Generated tokens per wall-clock second and the ratio HTTP / in-process. Runs
   are interleaved so background load hits both alike; best of R and the median are reported.
2. Sync: the default model (``ModelConfig()``, ~0.87M parameters) with a default LoRA adapter
   (rank 8 on q/k/v/o): adapter sync (write peft folder + ``/v1/load_lora_adapter``, acked)
   against full-weight sync (write HF folder + ``/update_weights_from_disk``), both through
   ``WeightSync`` into the same ``gyre serve`` process; bytes and seconds.

Run::

    python bench/http_engine.py            # P=8 G=8 N=32, R=5, sync x10
    python bench/http_engine.py --quick    # tiny sizes, for the smoke test

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gyre.config import EngineConfig, LoraConfig, ModelConfig
from gyre.engines import TorchEngine, WeightSync
from gyre.engines.http_engine import HttpEngine
from gyre.models.build import (
    count_parameters,
    create_tiny_checkpoint,
    load_pretrained,
)
from gyre.models.lora import apply_lora
from gyre.types import GenerationRequest, SamplingParams
from serve_helpers import start_server


def _requests(tokenizer, prompts: int, group: int, seed: int) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(prompts):
        n = int(torch.randint(8, 49, (1,), generator=g))
        ids = torch.randint(4, len(tokenizer), (n,), generator=g).tolist()
        out += [GenerationRequest([tokenizer.bos_token_id, *ids]) for _ in range(group)]
    return out


def _timed(engine, reqs, params) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = engine.generate(reqs, params)
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sync-repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sync-only", action="store_true", help="skip the throughput part")
    ap.add_argument("--hidden-size", type=int, default=ModelConfig().hidden_size)
    ap.add_argument("--num-layers", type=int, default=ModelConfig().num_layers)
    ap.add_argument("--intermediate-size", type=int, default=ModelConfig().intermediate_size)
    ns = ap.parse_args()
    if ns.quick:
        ns.prompts, ns.group, ns.new_tokens, ns.repeats, ns.sync_repeats = 2, 2, 4, 1, 1
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report: dict = {"bench": "http_engine", "threads": 1}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        mcfg = ModelConfig(
            hidden_size=ns.hidden_size,
            num_layers=ns.num_layers,
            intermediate_size=ns.intermediate_size,
        )
        create_tiny_checkpoint(mcfg, root / "model", seed=0)
        model, tokenizer = load_pretrained(root / "model", torch.device("cpu"))
        report["model_params"] = count_parameters(model)
        srv = start_server(root / "model", root)
        http = HttpEngine([srv.url], timeout_s=600, max_concurrency=256)
        local = TorchEngine(model, tokenizer.pad_token_id, seed=0)
        try:
            # -- 1. throughput --------------------------------------------------------------
            if ns.sync_only:
                ns.repeats = 0
            reqs = _requests(tokenizer, ns.prompts, ns.group, seed=0)
            params = SamplingParams(1.0, 1.0, ns.new_tokens, (), seed=0)
            if not ns.sync_only:
                _timed(local, reqs, params), _timed(http, reqs, params)  # warm up
            rates: dict[str, list[float]] = {"inproc": [], "http": []}
            tokens = {}
            for _ in range(ns.repeats):
                for name, eng in (("inproc", local), ("http", http)):
                    dt, n = _timed(eng, reqs, params)
                    rates[name].append(n / dt)
                    tokens[name] = n
            best = {k: max(v, default=float("nan")) for k, v in rates.items()}
            med = {k: statistics.median(v) if v else float("nan") for k, v in rates.items()}
            report["throughput"] = {
                "prompts": ns.prompts,
                "group": ns.group,
                "new_tokens": ns.new_tokens,
                "inproc_tok_s": best["inproc"],
                "http_tok_s": best["http"],
                "inproc_tok_s_median": med["inproc"],
                "http_tok_s_median": med["http"],
                "ratio_http_over_inproc": best["http"] / best["inproc"],
                "ratio_median": med["http"] / med["inproc"],
                "generated_tokens": tokens,
            }
            print(
                f"throughput  in-process {best['inproc']:8.0f} tok/s (median {med['inproc']:.0f})"
                f"  http {best['http']:8.0f} tok/s (median {med['http']:.0f})"
                f"  ratio {best['http'] / best['inproc']:.2f}x"
            )
            # -- 2. sync --------------------------------------------------------------------
            sync_dir = root / "sync"
            full = WeightSync(
                EngineConfig(kind="http", urls=[srv.url]),
                http,
                tokenizer,
                sync_dir / "full",
                lora=False,
            )
            plain, _ = load_pretrained(root / "model", torch.device("cpu"))
            policy = apply_lora(model, LoraConfig())
            ad = WeightSync(
                EngineConfig(kind="http", urls=[srv.url]),
                http,
                tokenizer,
                sync_dir / "lora",
                lora=True,
            )
            res: dict[str, dict[str, list[float]]] = {"adapter": {}, "full": {}}
            v = 0
            for _ in range(ns.sync_repeats):
                for name in ("full", "adapter"):
                    v += 1
                    t0 = time.perf_counter()
                    if name == "full":
                        m = full.sync(plain, v)
                    else:
                        m = ad.sync(policy, v)
                    total = time.perf_counter() - t0
                    r = res[name]
                    for k, val in (
                        ("total_s", total),
                        ("write_s", m["sync/write_s"]),
                        ("load_s", m["sync/load_s"]),
                        ("bytes", m["sync/bytes"]),
                    ):
                        r.setdefault(k, []).append(val)
            report["sync"] = {
                name: {k: statistics.median(vals) for k, vals in r.items()}
                for name, r in res.items()
            }
            report["sync"]["ratio_full_over_adapter_s"] = (
                report["sync"]["full"]["total_s"] / report["sync"]["adapter"]["total_s"]
            )
            for name in ("adapter", "full"):
                s = report["sync"][name]
                print(
                    f"sync {name:8s} {s['bytes'] / 1e6:7.3f} MB  total {s['total_s'] * 1e3:7.1f} ms"
                    f"  (write {s['write_s'] * 1e3:.1f} ms, load+ack {s['load_s'] * 1e3:.1f} ms)"
                )
        finally:
            http.close()
            srv.stop()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
