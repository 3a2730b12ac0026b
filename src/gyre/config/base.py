"""The config's base section (no unknown keys, finite floats) and the documented bounds."""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    model_validator,
)

_NULL_WORDS = ("null", "~")  # YAML's null; a key=value override keeps it as a string


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the value."""


class Section(BaseModel):
    # allow_inf_nan=False: every float field of every section must be finite (nan/inf would
    # reach the optimizer or the sampler and poison the weights); the error names the key.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_words(cls, data: Any) -> Any:
        """``key=null`` on the command line sets a nullable key to null (the override parser
        keeps ``null`` as text, so that a string key can still take the word)."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if (
                field is not None
                and isinstance(value, str)
                and value.strip().lower() in _NULL_WORDS
                and _admits_none(field.annotation)
            ):
                out[name] = None
        return out


def _admits_none(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)


# -- bounds (docs/operations.md, "NaN policy") ---------------------------------------------------
# AdamW moves each weight by about lr per step: above 1 every step overshoots any weight scale.
MAX_LR = 1.0
# Below this a temperature divides logits into overflow / a one-hot in all but name; 0 = greedy.
MIN_TEMPERATURE = 1e-2
# run.threads above cores x this oversubscribes to the point of failure (100000 segfaults).
THREADS_PER_CORE = 4
# numpy's legacy seeding (and SeedSequence users such as the data order) take [0, 2**32).
SEED_LIMIT = 2**32
# What a secret is written as in config.yaml, checkpoints and logs.
REDACTED = "***"
