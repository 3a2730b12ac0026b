"""``gyre report RUN_DIR``: one self-contained HTML file about a run, finished or live.

It reads only the run directory: ``config.yaml``, ``metrics.jsonl``, ``sft_metrics.jsonl``,
``samples.jsonl`` and ``summary.json`` (present once the run has finished). Plots are drawn with
matplotlib (the ``telemetry`` extra) and embedded as base64 PNGs, so the file can be mailed or
attached to a CI job as is. Sections: config, summary table, reward & success, KL & entropy,
response length & throughput, phase-time breakdown, evaluation before/after, and sample
episodes (maze episodes drawn step by step from the grid and positions in ``samples.jsonl``;
image episodes as the frame strips ``samples.jsonl`` names under ``frames/``).

A live run's files are read as they are: a half-written last line is ignored. ``--watch``
rewrites the report every ``--interval`` seconds (the page reloads itself at the same pace)
until the run has finished, then writes it a last time; started before the run directory
exists, it waits for it.
"""

from __future__ import annotations

import argparse
import base64
import datetime as _dt
import html
import io
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PHASE_PREFIX, PHASE_SUFFIX = "time/", "_s"
MAX_SAMPLES = 4
FRAMES_PER_ROW = 8


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file; a torn last line (a run writing right now) is skipped."""
    if not path.is_file():
        return []
    rows = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue  # being written
            raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
    return rows


@dataclass
class RunData:
    run_dir: Path
    config_text: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    sft: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None

    @property
    def train_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.metrics if "train/loss" in r or "rollout/reward_mean" in r]

    @property
    def eval_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.metrics if r.get("eval/success_greedy") is not None]

    @property
    def finished(self) -> bool:
        """summary.json is written last; a resumed run's old summary predates its metrics."""
        s, m = self.run_dir / "summary.json", self.run_dir / "metrics.jsonl"
        return s.is_file() and (not m.is_file() or s.stat().st_mtime >= m.stat().st_mtime)

    @property
    def total_steps(self) -> int | None:
        try:
            return int(self.config["train"]["steps"])
        except (KeyError, TypeError, ValueError):
            return None


def load_run(run_dir: str | Path) -> RunData:
    import yaml

    d = Path(run_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"run directory '{d}' does not exist")
    if not (d / "metrics.jsonl").is_file() and not (d / "config.yaml").is_file():
        raise FileNotFoundError(f"'{d}' holds neither metrics.jsonl nor config.yaml: not a run")
    data = RunData(d)
    if (d / "config.yaml").is_file():
        data.config_text = (d / "config.yaml").read_text()
        data.config = yaml.safe_load(data.config_text) or {}
    data.metrics = read_jsonl(d / "metrics.jsonl")
    data.sft = read_jsonl(d / "sft_metrics.jsonl")
    data.samples = read_jsonl(d / "samples.jsonl")
    if data.finished:
        data.summary = json.loads((d / "summary.json").read_text())
    return data


# -- plots -----------------------------------------------------------------------------------------


def _figure(width: float = 7.0, height: float = 3.2) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "gyre report draws with matplotlib: pip install 'gyre[telemetry]'"
        ) from exc
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _png(fig: Any, integer_x: bool = True) -> str:
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes if integer_x else ():  # steps are integers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _lines(
    ax: Any, rows: list[dict[str, Any]], keys: list[tuple[str, str]], **kw: Any
) -> list[Any]:
    handles = []
    for key, label in keys:
        xs, ys = _series(rows, key)
        if xs:
            handles += ax.plot(xs, ys, label=label, marker="o" if len(xs) < 30 else None, **kw)
    return handles


def plot_reward(data: RunData) -> str | None:
    rows, evals = data.train_rows, data.eval_rows
    if not rows and not evals:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    rollout = [("rollout/reward_mean", "reward (rollout)"), ("rollout/success_rate", "success")]
    _lines(ax, rows, rollout)
    evaluated = [
        ("eval/success_greedy", "eval (greedy)"),
        ("eval/success_sampled", "eval (sampled)"),
    ]
    _lines(ax, evals, evaluated, linestyle="--")
    ax.set(title="Reward and success", xlabel="GRPO step", ylim=(-0.03, 1.03))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def _twin(data: RunData, title: str, left: tuple[str, str], right: tuple[str, str]) -> str | None:
    rows = data.train_rows
    if not any(_series(rows, k)[0] for k in (left[0], right[0])):
        return None
    fig = _figure()
    ax = fig.add_subplot()
    h = _lines(ax, rows, [left], color="tab:blue")
    ax.set_ylabel(left[1], color="tab:blue")
    ax2 = ax.twinx()
    h += _lines(ax2, rows, [right], color="tab:orange")
    ax2.set_ylabel(right[1], color="tab:orange")
    ax.set(title=title, xlabel="GRPO step")
    ax.grid(alpha=0.3)
    ax.legend(handles=h, fontsize=8, loc="best")
    return _png(fig)


def plot_kl_entropy(data: RunData) -> str | None:
    return _twin(
        data, "KL and entropy", ("train/kl", "KL to reference"), ("train/entropy", "entropy (nats)")
    )


def plot_length_throughput(data: RunData) -> str | None:
    return _twin(
        data,
        "Response length and throughput",
        ("rollout/response_tokens_mean", "response tokens / episode"),
        ("perf/rollout_tokens_per_s", "rollout tokens/s"),
    )


def phase_keys(rows: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        for k in r:
            if k.startswith(PHASE_PREFIX) and k.endswith(PHASE_SUFFIX):
                seen[k] = None
    return list(seen)


def plot_phases(data: RunData) -> str | None:
    rows = data.train_rows
    keys = phase_keys(rows)
    if not rows or not keys:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    steps = [int(r["step"]) for r in rows]
    bottom = [0.0] * len(rows)
    for key in keys:
        vals = [float(r.get(key) or 0.0) for r in rows]
        name = key[len(PHASE_PREFIX) : -len(PHASE_SUFFIX)]
        ax.bar(steps, vals, bottom=bottom, label=name, width=0.85)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set(title="Phase time per step", xlabel="GRPO step", ylabel="seconds")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_sft(data: RunData) -> str | None:
    xs, ys = _series(data.sft, "sft/loss")
    if not xs:
        return None
    fig = _figure(7.0, 2.6)
    ax = fig.add_subplot()
    handles = ax.plot(xs, ys, label="SFT loss")
    handles += _lines(ax, data.sft, [("sft/val_loss", "held-out loss")], color="tab:red")
    right = ax.twinx()
    handles += _lines(right, data.sft, [("sft/token_acc", "token accuracy")], color="tab:green")
    handles += _lines(right, data.sft, [("sft/val_exact", "held-out replies exact")], ls="--")
    ax.set(title="SFT warm start", xlabel="SFT step", ylabel="loss")
    ax.grid(alpha=0.3)
    if len(handles) > 2:  # the validation curves (sft.validation_demos) need a legend
        ax.legend(handles=handles, fontsize=8)
    return _png(fig)


CELL_PX, GAP_PX = 12, 6
COLORS = {  # RGB of each cell kind in the episode frames
    "free": (255, 255, 255),
    "wall": (47, 54, 64),
    "visited": (207, 227, 255),
    "goal": (46, 204, 113),
    "agent": (231, 76, 60),
}


def maze_frame(
    walls: Any, visited: set[tuple[int, int]], goal: tuple[int, int], pos: tuple[int, int]
) -> Any:
    """One frame as an RGB array: a CELL_PX square per cell, the agent a smaller red square."""
    import numpy as np

    n, m = walls.shape
    img = np.empty((n * CELL_PX, m * CELL_PX, 3), dtype=np.uint8)
    for r in range(n):
        for c in range(m):
            kind = "wall" if walls[r, c] else "visited" if (r, c) in visited else "free"
            kind = "goal" if (r, c) == goal else kind
            img[r * CELL_PX : (r + 1) * CELL_PX, c * CELL_PX : (c + 1) * CELL_PX] = COLORS[kind]
    pad = CELL_PX // 4
    r, c = pos
    img[
        r * CELL_PX + pad : (r + 1) * CELL_PX - pad, c * CELL_PX + pad : (c + 1) * CELL_PX - pad
    ] = COLORS["agent"]
    img[:, ::CELL_PX] = img[::CELL_PX, :] = (200, 200, 200)  # grid lines
    return img


def draw_maze_episode(maze: dict[str, Any], actions: list[str] | None = None) -> str:
    """The episode as a strip of frames: the start, then the grid after every move (agent red,
    goal green, walls dark, cells already visited shaded), the move written above each frame."""
    import numpy as np

    walls = np.array([[ch == "#" for ch in row] for row in maze["walls"]], dtype=bool)
    positions = [tuple(maze["start"]), *[tuple(p) for p in maze["positions"]]]
    goal = tuple(maze["goal"])
    frames, visited = [], set()
    for pos in positions:
        visited.add(pos)
        frames.append(maze_frame(walls, visited, goal, pos))
    fh, fw = frames[0].shape[:2]
    cols = min(FRAMES_PER_ROW, len(frames))
    rows = math.ceil(len(frames) / cols)
    label_px = 14
    sheet = np.full((rows * (fh + GAP_PX + label_px), cols * (fw + GAP_PX), 3), 255, dtype=np.uint8)
    labels = []
    for i, frame in enumerate(frames):
        y = (i // cols) * (fh + GAP_PX + label_px) + label_px
        x = (i % cols) * (fw + GAP_PX)
        sheet[y : y + fh, x : x + fw] = frame
        move = "start" if i == 0 else f"{i}: {((actions or [])[i - 1 : i] or ['?'])[0].strip()[:4]}"
        labels.append((x + fw / 2, y - 3, move))
    scale = 2.0  # pixels of the sheet -> points: keeps 12 px cells readable
    fig = _figure(sheet.shape[1] * scale / 100, sheet.shape[0] * scale / 100)
    fig.set_layout_engine(None)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.imshow(sheet, interpolation="nearest")
    for x, y, text in labels:
        ax.text(x, y, text, ha="center", va="bottom", fontsize=7)
    ax.set_axis_off()
    return _png(fig, integer_x=False)


# -- HTML ------------------------------------------------------------------------------------------


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.1%}" if pct else f"{v:.4g}"
    return html.escape(str(v))


def _table(header: list[str] | None, rows: list[list[str]]) -> str:
    th = (
        "<thead><tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr></thead>" if header else ""
    )
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table>{th}<tbody>{body}</tbody></table>"


def _img(b64: str | None, alt: str) -> str:
    if b64 is None:
        return f'<p class="none">{html.escape(alt)}: no data yet.</p>'
    return f'<img class="plot" alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def summary_rows(data: RunData) -> list[list[str]]:
    train = data.train_rows
    last = train[-1] if train else {}
    total = data.total_steps
    done = int(last["step"]) if last else 0
    phases = phase_keys(train)
    spent = sum(float(r.get(k) or 0.0) for r in train for k in phases)
    tps = [r["perf/rollout_tokens_per_s"] for r in train if r.get("perf/rollout_tokens_per_s")]
    status = "finished" if data.finished else "running (or stopped before the end)"
    rows = [
        ["status", status],
        ["run dir", html.escape(str(data.run_dir))],
        ["env", _fmt((data.config.get("env") or {}).get("name"))],
        ["GRPO steps", f"{done} / {total if total is not None else '?'}"],
        ["SFT steps logged", str(len(data.sft))],
        ["last reward (rollout)", _fmt(last.get("rollout/reward_mean"))],
        ["last success (rollout)", _fmt(last.get("rollout/success_rate"), pct=True)],
        ["mean rollout tokens/s", _fmt(sum(tps) / len(tps) if tps else None)],
        ["time in GRPO phases", f"{spent:.1f} s"],
        ["samples recorded", str(len(data.samples))],
    ]
    if data.summary is not None:
        rows.append(["wall time (whole run)", f"{float(data.summary.get('wall_s', 0)):.1f} s"])
    return rows


def eval_rows(data: RunData) -> list[list[str]]:
    evals = data.eval_rows
    if data.summary is not None:
        before, after = data.summary.get("before") or {}, data.summary.get("after") or {}
        pairs = [("before GRPO", before), ("after GRPO", after)]
    else:
        pairs = []
        if evals:
            pairs.append((f"before GRPO (step {evals[0]['step']})", evals[0]))
        if len(evals) > 1:
            pairs.append((f"latest (step {evals[-1]['step']})", evals[-1]))
    return [
        [
            name,
            _fmt(e.get("eval/success_greedy"), pct=True),
            _fmt(e.get("eval/success_sampled"), pct=True),
            _fmt(e.get("eval/reward_greedy")),
            _fmt(e.get("eval/moves_greedy")),
        ]
        for name, e in pairs
    ]


def pick_samples(samples: list[dict[str, Any]], k: int = MAX_SAMPLES) -> list[dict[str, Any]]:
    """From the latest step with samples: successes and failures alternately, up to k."""
    if not samples:
        return []
    last = max(int(s["step"]) for s in samples)
    pool = [s for s in samples if int(s["step"]) == last]
    pool.sort(key=lambda s: not s.get("frames"))  # drawn image episodes first (a stable sort)
    wins = [s for s in pool if s.get("success")]
    losses = [s for s in pool if not s.get("success")]
    out: list[dict[str, Any]] = []
    while len(out) < k and (wins or losses):
        for group in (wins, losses):
            if group and len(out) < k:
                out.append(group.pop(0))
    return out


def frames_html(frames: dict[str, Any], run_dir: Path | None) -> str:
    """An image episode's frame strip (``samples.jsonl``'s ``frames``), embedded as a data URI."""
    path = (run_dir / frames["file"]) if run_dir is not None else Path(frames["file"])
    if not path.is_file():
        return f'<p class="none">frames: {html.escape(str(frames["file"]))} is missing.</p>'
    b64 = base64.b64encode(path.read_bytes()).decode("ascii")
    caps = " · ".join(str(c) for c in frames.get("captions", []))
    return (
        f"<p>{frames.get('count')} frames: what the policy saw, each under the action that "
        f"led to it ({html.escape(caps)})</p>" + _img(b64, "episode frames")
    )


def sample_html(s: dict[str, Any], run_dir: Path | None = None) -> str:
    head = (
        f"step {s['step']} · task seed {s.get('task_seed')} · reward {_fmt(s.get('reward'))} · "
        f"{s.get('turns')} turns · {'solved' if s.get('success') else 'not solved'}"
    )
    parts = [f'<div class="sample"><h3>{html.escape(head)}</h3>']
    if s.get("maze"):
        m = s["maze"]
        parts.append(
            f"<p>{m['size']}×{m['size']} maze, shortest path {m.get('shortest')} moves, "
            f"budget {m.get('budget')}</p>"
        )
        parts.append(_img(draw_maze_episode(m, s.get("actions")), "maze episode"))
    if s.get("frames"):
        parts.append(frames_html(s["frames"], run_dir))
    parts.append(f"<details><summary>episode text</summary><pre>{html.escape(s['text'])}</pre>")
    parts.append("</details></div>")
    return "".join(parts)


CSS = """
body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{margin-bottom:0}.sub{color:#666;margin-top:4px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:4px 10px;
text-align:left}th{background:#f3f3f3}.plots{display:flex;flex-wrap:wrap;gap:8px}
img.plot{max-width:100%;border:1px solid #eee}.plots img.plot{width:540px}
pre{background:#f7f7f7;padding:8px;
overflow:auto;max-height:360px}.sample{border-top:1px solid #ddd;padding-top:6px}
.none{color:#999}
"""


def render_html(data: RunData, refresh_s: int | None = None) -> str:
    """The whole report as one HTML string (plots embedded)."""
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    meta = f'<meta http-equiv="refresh" content="{int(refresh_s)}">' if refresh_s else ""
    plots = [
        _img(plot_reward(data), "reward and success"),
        _img(plot_kl_entropy(data), "KL and entropy"),
        _img(plot_length_throughput(data), "response length and throughput"),
        _img(plot_phases(data), "phase-time breakdown"),
    ]
    sft = plot_sft(data)
    samples = pick_samples(data.samples)
    evals = eval_rows(data)
    return "\n".join(
        [
            "<!doctype html><html><head><meta charset='utf-8'>",
            f"<title>gyre report: {html.escape(data.run_dir.name)}</title>{meta}",
            f"<style>{CSS}</style></head><body>",
            f"<h1>gyre run: {html.escape(data.run_dir.name)}</h1>",
            f'<p class="sub">generated {now}'
            + (f" · refreshes every {refresh_s}s" if refresh_s else "")
            + "</p>",
            "<h2>Summary</h2>",
            _table(None, summary_rows(data)),
            "<h2>Training curves</h2>",
            f'<div class="plots">{"".join(plots)}</div>',
            ("<h2>SFT warm start</h2>" + _img(sft, "SFT")) if sft else "",
            "<h2>Evaluation before / after</h2>",
            _table(
                [
                    "policy",
                    "greedy success",
                    "sampled success",
                    "mean reward (greedy)",
                    "mean moves (greedy)",
                ],
                evals,
            )
            if evals
            else '<p class="none">no evaluation logged yet.</p>',
            "<h2>Sample episodes</h2>",
            "".join(sample_html(s, data.run_dir) for s in samples)
            or '<p class="none">no samples.jsonl rows (telemetry.samples=0?).</p>',
            "<h2>Config</h2>",
            f"<pre>{html.escape(data.config_text) or '(no config.yaml)'}</pre>",
            "</body></html>",
        ]
    )


def write_report(
    run_dir: str | Path, out: str | Path | None = None, refresh_s: int | None = None
) -> Path:
    """Render ``run_dir`` to ``out`` (default ``<run_dir>/report.html``), atomically."""
    data = load_run(run_dir)
    path = Path(out) if out else data.run_dir / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_html(data, refresh_s), encoding="utf-8")
    tmp.replace(path)  # a browser reloading mid-write never sees half a file
    return path


def main(argv: list[str] | None = None) -> int:
    """``gyre report RUN_DIR [--out FILE] [--watch] [--interval S]``."""
    p = argparse.ArgumentParser(
        prog="gyre report",
        description="Write a self-contained HTML report (config, summary, plots, evaluation, "
        "sample episodes) of a finished or running run.",
    )
    p.add_argument("run_dir", help="the run directory (run.dir of gyre train)")
    p.add_argument("--out", help="output file (default RUN_DIR/report.html)")
    p.add_argument("--watch", action="store_true", help="rewrite the report until the run finishes")
    p.add_argument("--interval", type=int, default=15, help="seconds between rewrites (--watch)")
    ns = p.parse_args(argv)
    if ns.interval < 1:
        p.error("--interval must be at least 1 second")
    try:
        if not ns.watch:
            print(f"report written to {write_report(ns.run_dir, ns.out)}")
            return 0
        while True:
            try:
                finished = load_run(ns.run_dir).finished
            except FileNotFoundError as exc:  # started before the run wrote anything
                print(f"waiting: {exc}", flush=True)
                time.sleep(ns.interval)
                continue
            path = write_report(ns.run_dir, ns.out, None if finished else ns.interval)
            if finished:
                print(f"run finished; final report written to {path}", flush=True)
                return 0
            print(f"report updated: {path}", flush=True)
            time.sleep(ns.interval)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"gyre report: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
