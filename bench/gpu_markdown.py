"""``report.md`` of ``bench/gpu_check.py``: one table per section from ``report.json``."""

from __future__ import annotations

from typing import Any


def _f(x: Any, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_f(c) for c in r) + " |" for r in rows]
    return [*out, ""]


def _lean(r: dict) -> list[str]:
    rows = []
    for dtype, models in r.items():
        for name, d in models.items():
            rows.append(
                [
                    dtype,
                    name,
                    d.get("prefill_max_abs_diff"),
                    d.get("decode_max_abs_diff"),
                    d.get("logits_abs_max"),
                    d.get("error", ""),
                ]
            )
    return _table(
        ["dtype", "model", "prefill max abs diff", "decode max abs diff", "max abs logit", "error"],
        rows,
    )


def _engine(r: dict) -> list[str]:
    rows = []
    for model, res in r.items():
        if not isinstance(res, dict):
            continue
        for key, e in res.items():
            if not isinstance(e, dict):
                continue
            vs = e.get("vs_fp32_trainer") or {}
            s = e["same_dtype"]
            rows.append(
                [
                    model,
                    key,
                    s["max"],
                    s["mean"],
                    vs.get("max"),
                    vs.get("mean"),
                    s["tokens"],
                    s["outside_nucleus"] + vs.get("outside_nucleus", 0),
                    e["max_turns"],
                ]
            )
    return _table(
        [
            "model",
            "dtype / sampling",
            "max gap",
            "mean gap",
            "max gap vs fp32 trainer",
            "mean gap vs fp32 trainer",
            "policy tokens",
            "outside nucleus",
            "max turns",
        ],
        rows,
    )


def _throughput(r: dict) -> list[str]:
    lines = [
        f"model {r['model']} ({r['params']:,} params, {r['dtype']}), G={r['group_size']}, "
        f"{r['new_tokens']} new tokens, prompts {r['prompt_len'][0]}..{r['prompt_len'][1]}",
        "",
    ]
    rows = []
    for p in r["points"]:
        if "skipped" in p:
            rows.append([p["prompts"], "-", "skipped", "", "", "", p["skipped"]])
            continue
        for side in ("gyre", "hf"):
            s = p[side]
            rows.append(
                [
                    p["prompts"],
                    p["rows"],
                    side,
                    s["tok_s"],
                    s["seconds"],
                    s["peak_gib"],
                    s.get("mfu_vs_bfloat16"),
                ]
            )
    return lines + _table(
        ["prompts", "rows", "side", "tok/s", "s", "peak GiB", "MFU vs bf16"], rows
    )


def _step(r: dict) -> list[str]:
    rows = [
        [
            r["model"],
            r["dtype"],
            r["rows"],
            r["rollout_s"],
            r["update_s"],
            r["step_s"],
            r["peak_gib"],
            r["rollout"].get("mfu_vs_float32"),
            r["update"].get("mfu_vs_float32"),
            r["update"].get("mfu_vs_bfloat16"),
        ]
    ]
    out = _table(
        [
            "model",
            "dtype",
            "rows",
            "rollout s",
            "update s",
            "step s",
            "peak GiB",
            "rollout MFU vs fp32",
            "update MFU vs fp32",
            "update MFU vs bf16",
        ],
        rows,
    )
    return [*out, f"TRL: {r['trl'].get('skipped', r['trl'])}", ""]


def _scale(r: dict) -> list[str]:
    rows = []
    for mode, rungs in r["modes"].items():
        for g in rungs:
            rows.append(
                [
                    mode,
                    g["model"],
                    g.get("params"),
                    g.get("status"),
                    g.get("step_s"),
                    g.get("peak_gib"),
                    g.get("mfu_vs_float32"),
                    (g.get("error") or g.get("note") or "")[:120],
                ]
            )
    lines = [f"{r['dtype']}; batch {r['batch']}; largest that trains: {r['largest']}", ""]
    return lines + _table(
        ["mode", "model", "params", "status", "step s", "peak GiB", "MFU vs fp32", "note"], rows
    )


def _other(name: str, r: dict) -> list[str]:
    keys = {
        "pytest_gpu": ("summary", "files", "outcomes"),
        "matmul_peak": ("n", "bfloat16", "float32", "fp32_precision"),
        "grpo_run": (
            "returncode",
            "wall_s",
            "steps_done",
            "before",
            "after",
            "learned",
            "reward_first_half",
            "reward_last_half",
            "reward_per_step",
            "skipped",
        ),
    }.get(name, tuple(r))
    return _table(["figure", "value"], [[k, r.get(k)] for k in keys if k in r])


RENDER = {
    "lean_vs_hf": _lean,
    "engine_vs_trainer": _engine,
    "rollout_throughput": _throughput,
    "grpo_step": _step,
    "scale": _scale,
}


def to_markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    lines = [
        f"# gyre GPU check ({m['mode']})",
        "",
        f"{m['device_name']} | python {m['python']} | torch {m['torch']} (CUDA {m['cuda']}) | "
        f"transformers {m['transformers']} | commit {m['git_commit']} | "
        f"{m.get('elapsed_s')} s of {m['budget_s']:.0f} s",
        "",
        f"FLOPs: {m['flops_formula']}",
        "",
        "| section | status | seconds |",
        "|---|---|---|",
    ]
    for name, e in report["sections"].items():
        lines.append(f"| {name} | {e['status']} | {e.get('seconds', '-')} |")
    lines.append("")
    for name, e in report["sections"].items():
        lines.append(f"## {name}")
        lines.append("")
        if e["status"] != "ok":
            lines += [f"{e['status']}: {e.get('error') or e.get('note')}", ""]
            continue
        try:
            render = RENDER.get(name)
            lines += render(e["result"]) if render else _other(name, e["result"])
        except Exception as err:  # a table must never lose the JSON report
            lines += [f"(table failed: {type(err).__name__}: {err}; see report.json)", ""]
    return "\n".join(lines)
