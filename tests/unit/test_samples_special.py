"""samples.jsonl keeps what a chat template produced: special tokens and ids (BPE + ChatML)."""

from __future__ import annotations

import json

from gyre.telemetry.samples import SampleWriter
from gyre.types import Trajectory
from helpers import bpe_chat_tokenizer


def test_samples_keep_special_tokens_and_ids(tmp_path):
    tok = bpe_chat_tokenizer()
    prompt = list(
        tok.apply_chat_template(
            [{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    )
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    action = [*tok.encode("3", add_special_tokens=False), im_end]
    ids = prompt + action
    mask = [0] * len(prompt) + [1] * len(action)
    traj = Trajectory(ids, mask, [0.0] * len(ids), 1.0, 0, 0, 1, True, 7)
    w = SampleWriter(tmp_path / "samples.jsonl", 1.0, tok)
    assert w.write(1, [traj]) == 1
    w.close()
    (rec,) = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rec["token_ids"] == ids and rec["loss_mask"] == mask
    assert (
        rec["text_special"]
        == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n3<|im_end|>"
    )
    assert rec["text"] == "user\n1+2=\nassistant\n3"  # the readable view, as before
    assert rec["actions"] == ["3"]
    assert tok.decode(rec["token_ids"]) == rec["text_special"]
