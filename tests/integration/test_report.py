"""``gyre report``: the HTML's sections and embedded plots, live runs and --watch, and a real
headless Chromium rendering of the report to PNG."""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess
import threading
import time

import pytest

from gyre.cli import main
from system_tools import require_binary

pytest.importorskip("matplotlib")
from PIL import Image

IMG = re.compile(r'<img class="plot" alt="([^"]*)" src="data:image/png;base64,([^"]+)"')


def _images(page: str) -> list[tuple[str, Image.Image]]:
    return [(alt, Image.open(io.BytesIO(base64.b64decode(b64)))) for alt, b64 in IMG.findall(page)]


def test_report_of_a_finished_run(observed_run, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", str(observed_run), "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    page = out.read_text()
    imgs = _images(page)
    alts = [a for a, _ in imgs]
    for plot in ("reward and success", "KL and entropy", "response length and throughput",
                 "phase-time breakdown"):  # fmt: skip
        assert plot in alts, plot
    assert alts.count("maze episode") >= 1
    for alt, im in imgs:
        assert im.format == "PNG" and im.width > 100 and im.height > 50, alt
    # self-contained: nothing fetched from elsewhere
    assert not re.search(r'(src|href)="(?!data:)', page)
    assert "<script" not in page
    for section in ("Summary", "Training curves", "Evaluation before / after",
                    "Sample episodes", "Config"):  # fmt: skip
        assert f"<h2>{section}</h2>" in page
    assert "finished" in page and "before GRPO" in page and "after GRPO" in page
    assert "hidden_size: 32" in page  # the run's config
    assert 'http-equiv="refresh"' not in page


def test_maze_frames_follow_the_episode(observed_run):
    """One frame per move, and in frame i the red agent square sits on the i-th position."""
    import json

    import numpy as np

    from gyre.telemetry import report as R

    s = json.loads((observed_run / "samples.jsonl").read_text().splitlines()[0])
    maze = s["maze"]
    png = base64.b64decode(R.draw_maze_episode(maze, s["actions"]))
    im = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    path = [maze["start"], *maze["positions"]]
    cols = min(R.FRAMES_PER_ROW, len(path))
    fw = maze["size"] * R.CELL_PX
    row_h, col_w, scale = fw + R.GAP_PX + 14, fw + R.GAP_PX, 2
    assert im.shape[1] == cols * col_w * scale
    assert im.shape[0] == -(-len(path) // cols) * row_h * scale
    for i, (r, c) in enumerate(path):
        y = (i // cols) * row_h + 14 + r * R.CELL_PX + R.CELL_PX // 2
        x = (i % cols) * col_w + c * R.CELL_PX + R.CELL_PX // 2
        assert tuple(im[y * scale, x * scale]) == R.COLORS["agent"], (i, (r, c))
    gy = 14 + maze["goal"][0] * R.CELL_PX + 1
    gx = maze["goal"][1] * R.CELL_PX + 1
    assert tuple(im[gy * scale + 1, gx * scale + 1]) == R.COLORS["goal"]


def _live_copy(observed_run, tmp_path):
    live = tmp_path / "live"
    shutil.copytree(observed_run, live, ignore=shutil.ignore_patterns("tb", "final", "checkpoints"))
    (live / "summary.json").unlink()
    (live / "samples.jsonl").unlink()  # not needed here; fewer figures to draw per rewrite
    with (live / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "rollout/rew')  # a line being written right now
    return live


def test_report_of_a_live_run_and_watch(observed_run, tmp_path):
    live = _live_copy(observed_run, tmp_path)
    assert main(["report", str(live)]) == 0
    page = (live / "report.html").read_text()
    assert "running" in page and "latest (step 4)" in page

    # --watch started before the run directory exists waits for it
    watched = tmp_path / "later"
    done = {}
    t = threading.Thread(
        target=lambda: done.setdefault(
            "rc", main(["report", str(watched), "--watch", "--interval", "1"])
        ),
        daemon=True,
    )
    t.start()
    time.sleep(1.5)
    assert t.is_alive() and not watched.exists()
    shutil.copytree(live, watched)
    report = watched / "report.html"
    report.unlink()
    deadline = time.time() + 30
    while not report.is_file() or 'http-equiv="refresh" content="1"' not in report.read_text():
        assert time.time() < deadline, "--watch did not write a refreshing report"
        time.sleep(0.1)
    assert t.is_alive()  # still watching a live run
    shutil.copy(observed_run / "summary.json", watched / "summary.json")  # the run finishes
    t.join(30)
    assert done.get("rc") == 0
    final = report.read_text()
    assert 'http-equiv="refresh"' not in final and "finished" in final


def test_report_errors_name_the_directory(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 1
    assert "nope" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 1
    assert "not a run" in capsys.readouterr().err


CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
]


def test_chromium_renders_the_report(observed_run, tmp_path):
    binary = require_binary("chromium", "chromium")
    import numpy as np

    html = tmp_path / "report.html"
    assert main(["report", str(observed_run), "--out", str(html)]) == 0
    png = tmp_path / "shot.png"
    proc = subprocess.run(
        [
            binary,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1200,3600",
            f"--screenshot={png}",
            html.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and png.is_file(), proc.stderr[-2000:]
    shot = np.asarray(Image.open(png).convert("RGB")).astype(np.int32)
    assert shot.shape[:2] == (3600, 1200)
    assert shot.std() > 20, "the screenshot is blank"
    non_white = (shot.min(axis=2) < 240).mean()
    assert non_white > 0.05, non_white
    # The plots were decoded and painted: matplotlib's first two line colours (tab:blue
    # #1f77b4, tab:orange #ff7f0e) cover real areas of the page; broken images would not.
    for rgb in ((31, 119, 180), (255, 127, 14)):
        close = (np.abs(shot - np.array(rgb)).sum(axis=2) < 30).sum()
        assert close > 500, (rgb, close)
