"""The config's base section (no unknown keys, finite floats) and the documented bounds."""

from __future__ import annotations

import re

from pydantic import (
    BaseModel,
    ConfigDict,
)


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the value."""


class _Section(BaseModel):
    # allow_inf_nan=False: every float field of every section must be finite (nan/inf would
    # reach the optimizer or the sampler and poison the weights); the error names the key.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# -- bounds (docs/operations.md, "NaN policy") ---------------------------------------------------
# AdamW moves each weight by about lr per step: above 1 every step overshoots any weight scale.
MAX_LR = 1.0
# Below this a temperature divides logits into overflow / a one-hot in all but name; 0 = greedy.
MIN_TEMPERATURE = 1e-2
# run.threads above cores x this oversubscribes to the point of failure (100000 segfaults).
THREADS_PER_CORE = 4
# numpy's legacy seeding (and SeedSequence users such as the data order) take [0, 2**32).
SEED_LIMIT = 2**32
_DEVICE_RE = re.compile(r"^(cpu|auto|mps|cuda(:\d+)?)$")
# What a secret is written as in config.yaml, checkpoints and logs.
REDACTED = "***"
