"""Real checkpoints in by the paths users use: ``gyre import FILE.gguf`` (a tiny GGUF this test
writes with the ``gguf`` package's writer) and ``model.path`` as a hub id read from a hub cache
laid out here, offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.cli import main

pytest.importorskip("gguf")

from gguf_helpers import tiny_llama, write_llama_gguf
from helpers import bpe_chat_tokenizer, save_qwen2_bpe


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, torch.nn.Module, object]:
    tok = bpe_chat_tokenizer()
    model = tiny_llama(tok).eval()
    path = write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, tok)
    return path, model, tok


def test_gyre_import_writes_a_folder_that_loads_with_no_gguf_file(tiny_gguf, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, model, tok = tiny_gguf
    out = tmp_path / "imported"
    assert main(["import", str(src), "--out", str(out)]) == 0
    assert "llama, 0.0M parameters, vocabulary 320, chat template: yes" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= names
    assert not (out.parent / ".imported.importing").exists()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    loaded_tok = AutoTokenizer.from_pretrained(out)
    text = "What is 12+7? The answer is 19.<|im_end|>"
    assert loaded_tok.encode(text) == tok.encode(text)
    assert loaded_tok.chat_template == tok.chat_template
    assert loaded_tok.eos_token == "<|endoftext|>"
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():  # the permuted q/k rows came back in place: the very same function
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    record = json.loads((out / "gyre_import.json").read_text())
    import hashlib

    assert record["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert record["source"] == str(src.resolve()) and record["architecture"] == "llama"


def _import_error(argv: list[str], capsys) -> str:
    assert main(["import", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_gyre_import_refuses_bad_input_in_one_line_naming_the_file(tiny_gguf, tmp_path, capsys):
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    err = _import_error([str(text), "--out", str(tmp_path / "a")], capsys)
    assert str(text) in err and "not a GGUF file" in err
    assert not (tmp_path / "a").exists()

    bpe = bpe_chat_tokenizer()
    odd = write_llama_gguf(tmp_path / "odd.gguf", tiny_llama(bpe), bpe, architecture="jamba")
    err = _import_error([str(odd), "--out", str(tmp_path / "b")], capsys)
    assert str(odd) in err and "'jamba' cannot be dequantised by transformers" in err
    assert "tokenizer" not in err.split("(it reads")[1]  # only real architectures are listed

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    err = _import_error([str(tiny_gguf[0]), "--out", str(busy)], capsys)
    assert str(busy) in err and "not an empty folder" in err
    assert (busy / "keep.txt").read_text() == "mine"


def test_gyre_import_without_the_gguf_package_names_the_extra(
    tiny_gguf, tmp_path, capsys, monkeypatch
):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    err = _import_error([str(tiny_gguf[0]), "--out", str(tmp_path / "c")], capsys)
    assert str(tiny_gguf[0]) in err and "pip install 'gyre[gguf]'" in err


def _hub_cache(root: Path, repo: str) -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    save_qwen2_bpe(repo_dir / "snapshots" / commit)
    return repo_dir / "snapshots" / commit


def _gyre(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    code = "import sys; from gyre.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_model_path_takes_a_hub_id_from_the_offline_cache(tmp_path):
    snapshot = _hub_cache(tmp_path / "hub", "acme/tiny-chat")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    common = ["env.name=arithmetic", "eval.episodes=2", "log.console=off", "run.threads=1"]
    ok = _gyre(
        ["eval", "model.path=acme/tiny-chat", f"run.dir={tmp_path / 'r'}", *common], env, tmp_path
    )
    assert ok.returncode == 0, ok.stderr
    assert "eval/success_greedy" in json.loads((tmp_path / "r" / "eval.json").read_text())

    missing = _gyre(
        ["eval", "model.path=acme/absent", f"run.dir={tmp_path / 's'}", *common], env, tmp_path
    )
    assert missing.returncode == 2
    err = missing.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "model.path 'acme/absent'" in err and "HF_HUB_OFFLINE=1" in err
    assert snapshot.is_dir()
