"""TensorBoard: one scalar per logged key, event files in ``<run.dir>/tb``.

Written with ``torch.utils.tensorboard.SummaryWriter`` (which needs the ``tensorboard`` package,
in the ``telemetry`` extra). Tags are the metric keys unchanged (``rollout/reward_mean``), so
TensorBoard groups them by their prefix like the JSONL file does. Non-finite values are skipped,
as the JSONL file writes them as null.
"""

from __future__ import annotations

import math
from pathlib import Path


class TensorBoardSink:
    def __init__(self, log_dir: str | Path, config_text: str | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "telemetry.tensorboard=true needs the tensorboard package: "
                "pip install 'gyre[telemetry]'"
            ) from exc
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        if config_text:
            # Markdown code block so TensorBoard's Text tab keeps the YAML layout.
            self._writer.add_text("config", "```\n" + config_text + "\n```", 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                self._writer.add_scalar(key, float(value), step)
        self._writer.flush()  # a live run shows up in TensorBoard without waiting for close

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        self._writer.close()
