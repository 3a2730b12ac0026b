"""``gyre import FILE.gguf --out DIR``: a GGUF checkpoint as a plain Hugging Face folder.

The folder (safetensors weights, tokenizer, chat template, generation config, and
``gyre_import.json`` with the source file and its sha256) is what ``model.path`` takes; see
:mod:`gyre.models.gguf`. Needs the ``gguf`` extra.
"""

from __future__ import annotations

import argparse
import sys

from gyre.errors import InputError
from gyre.models.gguf import import_gguf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gyre import",
        description="Write a GGUF checkpoint as a plain Hugging Face folder (fp32 safetensors, "
        "tokenizer, chat template, generation config).",
    )
    parser.add_argument("gguf", metavar="FILE.gguf")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (new or empty)")
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        rec = import_gguf(ns.gguf, ns.out)
    except InputError as exc:
        print(f"gyre import: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"imported {ns.gguf} ({rec['architecture']}, {rec['parameters'] / 1e6:.1f}M parameters, "
        f"vocabulary {rec['vocab_size']}, chat template: {'yes' if rec['chat_template'] else 'no'})"
        f" to {ns.out}  sha256 {rec['sha256'][:16]}..."
    )
    return 0
