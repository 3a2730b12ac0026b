"""Vision-language models: loading, placeholder expansion, engine/trainer agreement, caches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gyre.engines.base import EngineFeatures
from gyre.engines.torch_engine import TorchEngine
from gyre.models.vision import load_vlm, to_image, vision_of
from gyre.rollout.chat import ChatMode, ChatTemplate
from gyre.rollout.episodes import run_episodes, turn_seed
from gyre.trainer.batch import collate, token_logprobs
from gyre.types import Completion, GenerationRequest, SamplingParams
from vision_helpers import ColourEnv, square, tiny_vlm

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "idefics3"])
def vlm(request, tmp_path_factory):
    folder = tiny_vlm(request.param, tmp_path_factory.getbasetemp() / "vlms")
    model, tok = load_vlm(folder, CPU)
    return request.param, model.eval(), tok


def _params(tpl: ChatTemplate, seed: int = 3) -> SamplingParams:
    return SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=6,
                          stop_token_ids=tpl.stop_ids(), seed=seed)  # fmt: skip


class Recording:
    """An engine wrapper that keeps every completion, by session, in order."""

    features = EngineFeatures()  # lockstep turns: one generate call per turn

    def __init__(self, engine: TorchEngine) -> None:
        self.engine, self.version, self.outs = engine, 0, {}

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list:
        outs = self.engine.generate(requests, params)
        for r, o in zip(requests, outs, strict=True):
            self.outs.setdefault(r.session, []).append(o)
        return outs

    def release(self, sessions) -> None:
        self.engine.release(sessions)


def test_tiny_vlms_load_through_the_auto_classes(vlm):
    kind, model, tok = vlm
    from transformers import AutoModelForImageTextToText

    assert model.config.model_type == kind
    assert type(model) in AutoModelForImageTextToText._model_mapping.values()
    vision = vision_of(tok)
    assert vision is not None and tok.chat_template
    img = square("red", 0)
    msgs = [{"role": "user", "content": [{"type": "image", "image": img},
                                         {"type": "text", "text": "colour?"}]}]  # fmt: skip
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = vision.expand(text, [img])
    assert ids.count(vision.image_token_id) == vision.num_tokens(img) >= 1
    with pytest.raises(ValueError, match=r"hold 2 image\(s\) but the rendered text has 1"):
        vision.expand(text, [img, img])
    with pytest.raises(ValueError, match="wrong image count"):
        vision.check(ids, [img, img], "row 0")


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen_positions_equal_get_rope_index(tmp_path_factory, kind):
    model, tok = load_vlm(tiny_vlm(kind, tmp_path_factory.getbasetemp() / "vlms"), CPU)
    vision = vision_of(tok)
    a, b = square("red", 1, 32), square("blue", 2, 64)  # two image sizes, two grids
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|vision_start|>" \
        "<|image_pad|><|vision_end|>x<|im_end|>\nok"  # fmt: skip
    ids = vision.expand(text, [a, b])
    grid = vision.inputs([[a, b]], CPU)["image_grid_thw"]
    x = torch.tensor([ids])
    ref, _ = model.model.get_rope_index(
        x, image_grid_thw=grid, mm_token_type_ids=(x == vision.image_token_id).int()
    )
    assert np.array_equal(ref[:, 0].numpy(), vision.positions(ids, [a, b]))


def test_message_images_are_checked():
    with pytest.raises(ValueError, match=r"expected an HxWx3 uint8 array, got float64"):
        to_image(np.zeros((4, 4, 3)), "x")
    from PIL import Image

    assert to_image(Image.new("RGB", (5, 4), (1, 2, 3))).shape == (4, 5, 3)
    from gyre.models.vision import images_in

    with pytest.raises(ValueError, match=r"message 0 content\[0\]: a part is"):
        images_in([{"role": "user", "content": [{"type": "video"}]}])


def test_text_model_refuses_images():
    from chat_helpers import build_chat_tokenizer

    tpl = ChatTemplate(build_chat_tokenizer("chatml"))
    with pytest.raises(ValueError, match="the model is text-only"):
        tpl.encode_images("x", [square("red", 0)], "reset() messages")


def test_multi_turn_engine_and_trainer_logprobs_agree(vlm):
    """fp32, temperature 0.7 / top-p 0.9, 3-turn visual episodes: the trainer's recomputed
    log-probs equal the engine's within 1e-4, and the loss mask covers exactly the sampled ids."""
    _kind, model, tok = vlm
    tpl = ChatTemplate(tok)
    engine = Recording(TorchEngine(model, tok.pad_token_id, vision=vision_of(tok)))
    trajs = run_episodes(lambda: ColourEnv(turns=3, pil=True), engine, tok, [1, 2], 3,
                         _params(tpl), chat=ChatMode(tpl), continuous=False)  # fmt: skip
    assert any(t.num_turns == 3 for t in trajs)
    for t, outs in zip(trajs, engine.outs.values(), strict=True):
        sampled = [i for o in outs for i in o.token_ids]
        assert [i for i, m in zip(t.token_ids, t.loss_mask, strict=True) if m] == sampled
        assert len(t.images) == t.num_turns  # one image per user turn
        vision_of(tok).check(t.token_ids, t.images, "trajectory")
    batch = collate(trajs, tok.pad_token_id, CPU, vision_of(tok))
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch, 0.7, 0.9, score_mask=batch.loss_mask)
    gap = ((lp - batch.rollout_logprobs).abs() * batch.loss_mask).max()
    assert float(gap) < 1e-4
    assert float((lp * (1 - batch.loss_mask)).abs().max()) == 0.0


def test_caches_and_forking_match_a_fresh_engine(vlm):
    """Shared-prompt forking, session KV reuse and continuous batching give the tokens that a
    fresh engine, fed each turn's whole prompt alone, samples."""
    _kind, model, tok = vlm
    tpl = ChatTemplate(tok)
    params = _params(tpl, seed=11)
    engine = TorchEngine(model, tok.pad_token_id, vision=vision_of(tok))
    trajs = run_episodes(lambda: ColourEnv(turns=2), engine, tok, [0, 3], 4, params,
                         chat=ChatMode(tpl))  # fmt: skip
    for i in (0, 5):
        t = trajs[i]
        for k, (start, end) in enumerate(t.turn_spans):
            n_img = sum(1 for s, _ in t.turn_spans[: k + 1])  # one image per turn so far
            fresh = TorchEngine(model, tok.pad_token_id, vision=vision_of(tok))
            req = GenerationRequest(t.token_ids[:start], seed=turn_seed(11, i, k),
                                    images=t.images[:n_img])  # fmt: skip
            out: Completion = fresh.generate([req], params.__class__(**{
                **params.__dict__, "seed": None}))[0]  # fmt: skip
            assert out.token_ids[: end - start] == t.token_ids[start:end]
            assert np.allclose(out.logprobs[: end - start], t.rollout_logprobs[start:end],
                               atol=1e-5)  # fmt: skip


def test_forking_shares_only_prompts_with_the_same_images(tmp_path_factory):
    """A group's identical prompt (images included) is prefilled once; equal ids (the same
    number of placeholder tokens) with other pixels are not shared."""
    model, tok = load_vlm(tiny_vlm("qwen2_5_vl", tmp_path_factory.getbasetemp() / "vlms"), CPU)
    vision = vision_of(tok)
    text = "<|vision_start|><|image_pad|><|vision_end|>colour?"
    a, b = square("red", 0), square("green", 0)
    ids = vision.expand(text, [a])
    assert ids == vision.expand(text, [b])
    engine = TorchEngine(model, tok.pad_token_id, vision=vision)
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    same = engine.generate([GenerationRequest(ids, images=[a]) for _ in range(4)], params)
    assert engine.stats["prefill_tokens"] == len(ids)
    assert len({tuple(o.token_ids) for o in same}) == 1
    reqs = [GenerationRequest(ids, images=[a]), GenerationRequest(ids, images=[b])]
    engine.generate(reqs, params)
    assert engine.stats["prefill_tokens"] == 3 * len(ids)
    with pytest.raises(ValueError, match="wrong image count"):
        engine.generate([GenerationRequest(ids, images=[a, b])], params)


def test_disk_sync_loads_a_saved_vlm_folder(tmp_path, tmp_path_factory):
    """engine.weight_sync=disk: a VLM folder written with the checkpoint's key names loads."""
    folder = tiny_vlm("qwen2_5_vl", tmp_path_factory.getbasetemp() / "vlms")
    model, tok = load_vlm(folder, CPU)
    other, _ = load_vlm(folder, CPU)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01)
    other.save_pretrained(tmp_path / "v1")
    engine = TorchEngine(model, tok.pad_token_id, vision=vision_of(tok))
    assert engine.load_weights_from_disk(tmp_path / "v1", 1) == 1
    mine, theirs = engine.model.state_dict(), other.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_stepwise_visual_turns_score_like_the_engine(tmp_path_factory):
    """rollout.stepwise with images (Idefics3's template is not prefix-stable): every turn's
    sample carries the images it saw, and the trainer's log-probs match the engine's."""
    from gyre.trainer.stepwise import expand_steps

    model, tok = load_vlm(tiny_vlm("idefics3", tmp_path_factory.getbasetemp() / "vlms"), CPU)
    tpl = ChatTemplate(tok)
    engine = TorchEngine(model, tok.pad_token_id, vision=vision_of(tok))
    trajs = run_episodes(lambda: ColourEnv(turns=3), engine, tok, [1], 3, _params(tpl),
                         chat=ChatMode(tpl, stepwise=True))  # fmt: skip
    rows, _ = expand_steps(trajs)
    assert len(rows) == sum(t.num_turns for t in trajs)
    assert sorted({len(r.images) for r in rows}) == [1, 2, 3][: max(t.num_turns for t in trajs)]
    batch = collate(rows, tok.pad_token_id, CPU, vision_of(tok))
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch, 0.7, 0.9, score_mask=batch.loss_mask)
    assert float(((lp - batch.rollout_logprobs).abs() * batch.loss_mask).max()) < 1e-4


def test_http_engine_sends_images_only_in_the_sglang_dialect():
    """vLLM's /v1/completions takes token ids without images: refused in one line (images go
    with engine.api=sglang, tests/integration/test_http_vision.py)."""
    from gyre.engines.http_engine import HttpEngine

    engine = HttpEngine(["http://127.0.0.1:9"], model="m")
    req = GenerationRequest([1, 2], images=[square("red", 0)])
    with pytest.raises(ValueError, match=r"engine\.api=openai .* takes no images; set engine"):
        engine.generate([req], SamplingParams())


def test_model_kind_with_a_path_is_refused():
    from gyre.config import load_config

    with pytest.raises(Exception, match=r"model.kind='idefics3' builds a tiny default"):
        load_config(None, ["model.kind=idefics3", "model.path=/some/folder"])
