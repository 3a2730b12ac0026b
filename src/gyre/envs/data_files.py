"""Prompt datasets in the ecosystem's formats: JSONL, JSON, Parquet and Arrow files.

``env.dataset.path`` names the file; ``env.dataset.format`` (``auto``: by extension) says how to
read it:

=========  ==========================================  ============================================
format     files                                       read by
=========  ==========================================  ============================================
jsonl      ``*.jsonl``                                 gyre's reader (errors name ``file:line``)
json       ``*.json`` (JSON lines or a JSON array)     ``datasets.load_dataset("json")``
parquet    ``*.parquet``                               ``datasets.load_dataset("parquet")``
arrow      ``*.arrow``, or a folder from               ``Dataset.from_file`` / ``load_from_disk``
           ``Dataset.save_to_disk``                    (a ``DatasetDict``: its ``train`` split)
=========  ==========================================  ============================================

Hugging Face ``datasets`` is the ``datasets`` extra (``pip install 'gyre[datasets]'``); the JSONL
reader needs nothing. The column mapping is ``env.dataset.prompt_field`` / ``answer_field``; every
other column is task metadata handed to reward functions. A missing column is one error naming
the column and the file; a bad row names the file and the row (``file[row 3]``, 0-based).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyre.envs.dataset import Task, load_jsonl_tasks, task_from_row
from gyre.errors import InputError

FORMATS = ("jsonl", "json", "parquet", "arrow")
_BY_SUFFIX = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
MISSING = (
    "env.dataset.format={fmt} needs the Hugging Face datasets package: pip install 'gyre[datasets]'"
)


def file_format(path: str | Path, fmt: str = "auto") -> str:
    """The format ``path`` is read as: ``fmt`` unless ``auto``, else by its extension."""
    if fmt != "auto":
        return fmt
    p = Path(path)
    if p.is_dir():
        return "arrow"
    found = _BY_SUFFIX.get(p.suffix.lower())
    if found is None:
        raise InputError(
            f"env.dataset.path '{p}': cannot tell the format from the extension "
            f"'{p.suffix}'; set env.dataset.format to one of {', '.join(FORMATS)}"
        )
    return found


def load_tasks(
    path: str | Path,
    fmt: str = "auto",
    prompt_field: str = "prompt",
    answer_field: str = "answer",
) -> list[Task]:
    """Every row of the dataset as a validated :class:`Task` (see the module docstring)."""
    if not str(path):
        raise InputError("env.dataset.path is empty; set it to a JSONL, Parquet or Arrow file")
    p = Path(path)
    if not p.exists():
        raise InputError(f"env.dataset.path '{p}' does not exist")
    kind = file_format(p, fmt)
    if kind == "jsonl":
        return load_jsonl_tasks(p, prompt_field, answer_field)
    ds = _read(p, kind)
    for key, field in ((prompt_field, "prompt_field"), (answer_field, "answer_field")):
        if key not in ds.column_names:
            raise InputError(
                f"{p}: no column '{key}' (env.dataset.{field}); columns: {ds.column_names}"
            )
    if len(ds) == 0:
        raise InputError(f"env.dataset.path '{p}' holds no rows")
    # Task.line is 1-based (gyre.rollout.context names a too-long prompt as `file:line`)
    return [
        task_from_row(row, f"{p}[row {i}]", i + 1, prompt_field, answer_field)
        for i, row in enumerate(ds.to_list())
    ]


def _read(p: Path, kind: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise InputError(MISSING.format(fmt=kind)) from None
    datasets.disable_progress_bars()
    try:
        if kind == "arrow":
            if p.is_dir():
                ds = datasets.load_from_disk(str(p))
                if isinstance(ds, datasets.DatasetDict):
                    if "train" not in ds:
                        raise InputError(f"{p}: a DatasetDict without a 'train' split ({list(ds)})")
                    ds = ds["train"]
                return ds
            return datasets.Dataset.from_file(str(p))
        return datasets.load_dataset(kind, data_files=str(p), split="train")
    except InputError:
        raise
    except Exception as exc:  # pyarrow / datasets parse errors: one line naming the file
        text = str(exc).strip().splitlines()
        raise InputError(
            f"{p}: not a readable {kind} dataset ({type(exc).__name__}: {text[0] if text else ''})"
        ) from None
