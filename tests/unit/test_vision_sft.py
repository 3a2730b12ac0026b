"""SFT on message-mode envs, images included: a demonstration is the rollout's own rendering."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from chat_helpers import ScriptedEngine, build_chat_tokenizer
from gyre.config import load_config
from gyre.envs import env_factory
from gyre.envs.maze import MazeEnv
from gyre.models.vision import load_vlm, vision_of
from gyre.rollout.chat import ChatMode, ChatTemplate
from gyre.rollout.demonstrate import demonstrate
from gyre.rollout.episodes import run_episodes
from gyre.telemetry.frames import replay_frames
from gyre.types import SamplingParams
from vision_helpers import tiny_vlm

pytest.importorskip("PIL.Image")


class Recorder:
    """A demonstrator env that keeps the replies it was sent (to script the rollout with)."""

    def __init__(self, env, log: list[str]) -> None:
        self.env, self.log = env, log
        self.message_mode = True

    def reset(self, seed):
        self.log.clear()
        return self.env.reset(seed)

    def step(self, action):
        self.log.append(action)
        return self.env.step(action)

    def expert_action(self, rng):
        return self.env.expert_action(rng)

    def random_action(self, rng):
        return self.env.random_action(rng)


class TextMessageMaze:
    """The text maze as a message-mode env (string contents), for a text chat tokenizer."""

    message_mode = True

    def __init__(self) -> None:
        self.maze = MazeEnv()

    def reset(self, seed):
        return [{"role": "user", "content": self.maze.reset(seed)}]

    def step(self, action):
        obs, r, done, info = self.maze.step(action)
        return ([] if done else [{"role": "user", "content": obs}]), r, done, info

    def expert_action(self, rng):
        return self.maze.expert_action(rng)

    def random_action(self, rng):
        return self.maze.random_action(rng)


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    folder = tiny_vlm("qwen2_5_vl", tmp_path_factory.getbasetemp() / "vlms")
    return load_vlm(folder, torch.device("cpu"))[1]


def _visual_maze(*overrides: str):
    return env_factory(load_config(None, ["env.name=visual_maze", *overrides]).env)


def _demo_and_rollout(make, tok, seed, noise, train_on_noise=False, **mode):
    """A demonstration, and run_episodes replaying its replies as the policy's samples."""
    log: list[str] = []
    chat = ChatMode(ChatTemplate(tok), **mode)
    rng = np.random.default_rng(seed)
    recorder = lambda: Recorder(make(), log)  # noqa: E731
    demo = demonstrate(recorder, tok, seed, noise, rng, train_on_noise=train_on_noise, chat=chat)
    actions = list(log)
    engine = ScriptedEngine(tok, actions, chat.template.end_id)
    (traj,) = run_episodes(make, engine, tok, [seed], 1, SamplingParams(), chat=chat)
    return demo, traj, actions, chat.template


def _mask_text(tok, traj) -> str:
    return tok.decode([i for i, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m])


@pytest.mark.parametrize("seed", [3, 11, 2**31 + 1])
def test_visual_demonstration_is_the_rollouts_rendering(qwen_tok, seed):
    """ids, loss mask and images of a noise-free demonstration equal what the rollout records
    for the same replies; the mask is exactly the replies and their end-of-turn token."""
    demo, traj, actions, tpl = _demo_and_rollout(_visual_maze(), qwen_tok, seed, noise=0.0)
    assert demo.success and traj.success and demo.num_turns == traj.num_turns == len(actions)
    assert demo.token_ids == traj.token_ids
    assert demo.loss_mask == traj.loss_mask
    assert len(demo.images) == len(traj.images) == len(actions)
    assert all(np.array_equal(a, b) for a, b in zip(demo.images, traj.images, strict=True))
    vision = vision_of(qwen_tok)
    vision.check(demo.token_ids, demo.images, "demonstration")
    assert demo.token_ids.count(vision.image_token_id) == sum(map(vision.num_tokens, demo.images))
    end = tpl.end_text
    assert _mask_text(qwen_tok, demo) == end.join(actions) + end
    # the whole demonstration is the template's rendering of its conversation, expanded
    env = _visual_maze()()
    conv = env.reset(seed)
    for a in actions:
        conv.append({"role": "assistant", "content": a})
        new, *_ = env.step(a)
        conv.extend(new)
    text = tpl.render(conv[: 2 * len(actions)], False)  # the final step's messages: not shown
    assert demo.token_ids == vision.expand(text, demo.images)


def test_noisy_visual_demonstration_masks_only_the_random_replies(qwen_tok):
    make = _visual_maze()
    kept, traj, *_ = _demo_and_rollout(make, qwen_tok, 5, 0.5, train_on_noise=True)
    masked, *_ = _demo_and_rollout(make, qwen_tok, 5, 0.5)
    assert kept.token_ids == masked.token_ids == traj.token_ids
    assert kept.loss_mask == traj.loss_mask
    assert all(np.array_equal(a, b) for a, b in zip(masked.images, traj.images, strict=True))
    dropped = [i for i, (k, m) in enumerate(zip(kept.loss_mask, masked.loss_mask, strict=True))
               if k != m]  # fmt: skip
    assert dropped and all(masked.loss_mask[i] == 0 for i in dropped)
    assert 0 < masked.num_generated < kept.num_generated


@pytest.mark.parametrize("kind", ["chatml", "llama3"])
def test_text_message_demonstration_with_a_bpe_chat_tokenizer(kind):
    """A real byte-level BPE with its chat template (no images): the same equality."""
    tok = build_chat_tokenizer(kind)
    demo, traj, actions, tpl = _demo_and_rollout(TextMessageMaze, tok, 7, noise=0.0)
    assert demo.token_ids == traj.token_ids and demo.loss_mask == traj.loss_mask
    assert not demo.images and demo.success
    assert _mask_text(tok, demo) == tpl.end_text.join(actions) + tpl.end_text
    assert not demo.info["template_drift"]


def test_context_limit_ends_a_demonstration_as_it_ends_a_rollout(qwen_tok):
    demo, traj, *_ = _demo_and_rollout(_visual_maze(), qwen_tok, 3, 0.0, max_context_tokens=400)
    assert demo.info["truncated_context"] and traj.info["truncated_context"]
    assert demo.token_ids == traj.token_ids and len(demo.token_ids) <= 400
    assert len(demo.images) == len(traj.images) < demo.num_turns + 1


def test_warm_start_demonstrations_carry_images_and_cache(qwen_tok, tmp_path):
    from gyre.sft import demonstrations

    over = ["env.name=visual_maze", "sft.demos=3", "model.kind=qwen2_5_vl"]
    cfg = load_config(None, over)
    demos = demonstrations(cfg, tmp_path, qwen_tok)
    assert len(demos) == 3 and all(d.images and len(d.images) <= d.num_turns for d in demos)
    again = demonstrations(cfg, tmp_path, qwen_tok)  # from sft_demos.pt
    raw = sum(im.nbytes for d in demos for im in d.images)
    assert (tmp_path / "sft_demos.pt").stat().st_size < raw / 4  # the images cached as PNGs
    chat = ChatMode(ChatTemplate(qwen_tok))
    rng = np.random.default_rng([cfg.run.seed, 1])  # the SFT stream's (warmstart.STREAM_SFT)
    first = demonstrate(env_factory(cfg.env), qwen_tok, demos[0].task_seed, cfg.sft.noise, rng,
                        chat=chat)  # fmt: skip
    assert first.token_ids == demos[0].token_ids and first.loss_mask == demos[0].loss_mask
    for a, b in zip(demos, again, strict=True):
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask
        assert all(np.array_equal(x, y) for x, y in zip(a.images, b.images, strict=True))
        assert all(x.dtype == np.uint8 and x.shape == (84, 84, 3) for x in b.images)
    assert all(np.array_equal(x, y) for x, y in zip(first.images, demos[0].images, strict=True))
    with pytest.raises(ValueError, match=r"rollout\.tools"):
        demonstrations(load_config(None, [*over, "rollout.tools=[python]"]), tmp_path, qwen_tok)


def test_windowed_demonstrations_share_their_frames(qwen_tok, tmp_path):
    """With step-wise rows (rollout.history_turns=0) an episode and its steps hold the same
    frames: decoded once from the cache, shared, not one copy per holder."""
    from gyre.sft import demonstrations

    over = ["env.name=visual_maze", "sft.demos=4", "model.kind=qwen2_5_vl",
            "rollout.history_turns=0", "rollout.keep_opening=false"]  # fmt: skip
    cfg = load_config(None, over)
    fresh = demonstrations(cfg, tmp_path, qwen_tok)
    again = demonstrations(cfg, tmp_path, qwen_tok)  # from sft_demos.pt
    for a, b in zip(fresh, again, strict=True):
        assert a.steps and len(a.steps) == len(b.steps) and len(b.images) > 1
        held = {id(im) for im in b.images}
        for sa, sb in zip(a.steps, b.steps, strict=True):
            assert sa.token_ids == sb.token_ids and len(sb.images) == 1
            assert np.array_equal(sa.images[0], sb.images[0]) and id(sb.images[0]) in held
    frames = {id(im) for d in again for im in d.images}
    assert len(frames) == len({im.tobytes() for d in again for im in d.images})


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl", "idefics3"])
def test_tiny_vlm_language_model_size_is_config(kind, tmp_path):
    """model.tiny_vlm sizes the tiny VLM's language model (its defaults: the built-in one)."""
    from gyre.config import ConfigError
    from gyre.models.vision_build import LMSize, create_tiny_vlm
    from gyre.trainer.batch import collate, token_logprobs
    from vision_helpers import ColourEnv

    sizes = ["hidden_size=96", "num_layers=3", "intermediate_size=192"]
    cfg = load_config(None, [f"model.kind={kind}", *(f"model.tiny_vlm.{s}" for s in sizes)])
    lm = LMSize(**cfg.model.tiny_vlm.model_dump())
    assert LMSize(**load_config(None, []).model.tiny_vlm.model_dump()) == LMSize()
    model, tok = load_vlm(create_tiny_vlm(kind, tmp_path / "m", 0, lm), torch.device("cpu"))
    text = model.config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.intermediate_size) == (96, 3, 192)
    chat = ChatMode(ChatTemplate(tok))
    engine = ScriptedEngine(tok, ["red"], chat.template.end_id)
    trajs = run_episodes(lambda: ColourEnv(turns=1), engine, tok, [0, 1], 1, SamplingParams(),
                         chat=chat)  # fmt: skip
    batch = collate(trajs, tok.pad_token_id, torch.device("cpu"), vision_of(tok))
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch, score_mask=batch.loss_mask)
    assert torch.isfinite(lp).all() and (lp[batch.loss_mask.bool()] < 0).all()
    with pytest.raises(ConfigError, match=r"model\.tiny_vlm"):
        load_config(None, ["model.tiny_vlm.hidden_size=100"])


def test_samples_draw_a_few_image_episodes_frame_by_frame(qwen_tok, tmp_path):
    """samples.jsonl: the first `frames` written image episodes of a step get a PNG strip under
    frames/ (the images the policy saw, then the final frame, captioned with the actions);
    gyre report embeds it."""
    from PIL import Image

    from gyre.telemetry.report import load_run, render_html
    from gyre.telemetry.samples import SampleWriter

    make = _visual_maze()
    chat = ChatMode(ChatTemplate(qwen_tok))
    moves = ["u", "r", "x", "d", "l", "u", "u", "r", "r", "d"] * 3
    engine = ScriptedEngine(qwen_tok, moves, chat.template.end_id)
    trajs = run_episodes(make, engine, qwen_tok, [3, 4, 5], 1, SamplingParams(), chat=chat)
    w = SampleWriter(tmp_path / "samples.jsonl", 1.0, qwen_tok, make, seed=0, frames=2)
    assert w.write(7, trajs) == 3
    w.close()
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    drawn = [r for r in rows if "frames" in r]
    assert [r["index"] for r in drawn] == [0, 1] and "frames" not in rows[2]
    assert (tmp_path / "samples.jsonl").stat().st_size < 40_000 * len(rows)  # no pixels inside
    for r in drawn:
        t = trajs[r["index"]]
        f = r["frames"]
        assert f["file"] == f"frames/step_000007_{r['index']:04d}.png"
        assert f["count"] == len(t.images) + 1 == t.num_turns + 1  # + the frame after the last
        assert f["captions"] == ["start", *[f"{k} {a}" for k, a in enumerate(r["actions"], 1)]]
        strip = np.asarray(Image.open(tmp_path / f["file"]).convert("RGB"))
        side = t.images[0].shape[0]  # 84 px: drawn at scale 1, 2 px apart, a caption band
        assert strip.shape == (side + 12, f["count"] * (side + 2) - 2, 3)
        env = make()
        final = replay_frames(env, t.task_seed, r["actions"])[-1]
        for k, img in enumerate([*t.images, np.asarray(final)]):
            x = k * (side + 2)
            assert np.array_equal(strip[:side, x : x + side], img), k
    (tmp_path / "config.yaml").write_text("env: {name: visual_maze}\n")
    html = render_html(load_run(tmp_path))
    png = (tmp_path / drawn[0]["frames"]["file"]).read_bytes()
    assert base64.b64encode(png).decode() in html and "start · 1 u · 2 r" in html
    (tmp_path / drawn[0]["frames"]["file"]).unlink()
    assert "is missing" in render_html(load_run(tmp_path))


def test_the_visual_maze_example_keeps_the_text_mazes_rules():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "examples" / "visual-maze" / "config.yaml")
    text = load_config(root / "examples" / "maze" / "config.yaml")
    assert cfg.env.name == "visual_maze" and cfg.model.kind == "qwen3_vl" and cfg.sft.steps > 0
    rules = ("size", "wall_density", "min_distance", "budget_factor")
    assert all(getattr(cfg.env.maze, k) == getattr(text.env.maze, k) for k in rules)
    assert cfg.eval.episodes >= 200  # the before/after table on held-out mazes
    # its image tokens are aligned on the agent: the 3x3 cells around it are one token's
    # pixels (2x2 merged patches), the picture a whole number of tokens
    token, cell = 2 * cfg.model.tiny_vlm.patch_size, cfg.env.visual_maze.cell_px
    radius = cfg.env.maze.size - 1  # view=agent: the (2r+1)-cell square centred on the agent
    assert cfg.env.visual_maze.view == "agent"
    assert (radius - 1) * cell // token == ((radius + 2) * cell - 1) // token
    assert (2 * radius + 1) * cell % token == 0 and token % cfg.env.visual_maze.pad_to == 0


@pytest.mark.parametrize("image_last", [False, True])
def test_image_last_puts_the_image_a_fixed_distance_before_the_reply(qwen_tok, image_last):
    """env.visual_maze.image_last: in a memoryless turn's prompt the image's tokens end a fixed
    number of tokens before the reply, whatever the turn's text says; image first, they do not
    (the feedback text's length varies between turns)."""
    from gyre.rollout.window import Window

    make = _visual_maze(
        "env.visual_maze.view=agent",
        "env.visual_maze.cell_px=8",
        "env.visual_maze.pad_to=16",
        f"env.visual_maze.image_last={image_last}",
    )
    chat = ChatMode(ChatTemplate(qwen_tok), window=Window(0, keep_opening=False))
    vision = vision_of(qwen_tok)
    gaps, texts = set(), set()
    for seed in range(6):
        demo = demonstrate(make, qwen_tok, seed, 0.5, np.random.default_rng(seed),
                           train_on_noise=True, chat=chat)  # fmt: skip
        assert demo.steps and len(demo.steps) == demo.num_turns
        for s in demo.steps:
            assert len(s.images) == 1  # memoryless: the current picture only
            vision.check(s.token_ids, s.images, "turn")
            reply = s.loss_mask.index(1)
            last_image = max(i for i, t in enumerate(s.token_ids) if t == vision.image_token_id)
            gaps.add(reply - last_image)
            texts.add(len(s.token_ids) - s.token_ids.count(vision.image_token_id))
    assert len(texts) > 2  # the turns' texts differ in length ...
    assert (len(gaps) == 1) == image_last  # ... yet image last, the image sits where it did


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_tiny_vlm_patch_size_keeps_the_language_models_draw(kind, tmp_path):
    """model.tiny_vlm.patch_size changes the tower; the tiny Qwen3-VL's language model keeps
    its initial weights (drawn from the seed and its own shape, not after however many draws
    the tower took); with qwen3_vl, 8-px patches and 16-px cells give one image token per maze
    cell. (The Qwen2.5-VL default keeps its measured draw, which follows the tower.)"""
    from safetensors.torch import load_file

    from gyre.config import ConfigError
    from gyre.envs.visual_maze import Drawing, VisualMazeEnv
    from gyre.models.vision_build import LMSize, create_tiny_vlm

    own = create_tiny_vlm(kind, tmp_path / "own", 3, LMSize())
    other = create_tiny_vlm(
        kind, tmp_path / "p", 3, LMSize(patch_size=4 if kind == "qwen2_5_vl" else 8)
    )
    a, b = load_file(own / "model.safetensors"), load_file(other / "model.safetensors")
    lm_keys = [k for k in a if "visual" not in k]
    same = all(torch.equal(a[k], b[k]) for k in lm_keys)
    assert lm_keys and same == (kind == "qwen3_vl")
    patch = next(k for k in a if k.endswith("visual.patch_embed.proj.weight"))
    assert a[patch].shape != b[patch].shape
    third = load_file(create_tiny_vlm(kind, tmp_path / "s", 4, LMSize()) / "model.safetensors")
    assert not torch.equal(a[lm_keys[0]], third[lm_keys[0]])  # another seed, another draw
    if kind == "qwen3_vl":
        _, tok = load_vlm(other, torch.device("cpu"))
        env = VisualMazeEnv(MazeEnv(), Drawing(cell_px=16, pad_to=16, view="agent"))
        env.reset(0)
        assert vision_of(tok).num_tokens(env.pixels()) == 81  # 9 x 9 cells around the agent
    with pytest.raises(ValueError, match=r"patch_size"):
        create_tiny_vlm("idefics3", tmp_path / "i", 0, LMSize(patch_size=8))
    with pytest.raises(ConfigError, match=r"model\.tiny_vlm\.patch_size"):
        load_config(None, ["model.tiny_vlm.patch_size=7"])


def test_tiny_vlm_tower_width_and_position_grid(tmp_path):
    """model.tiny_vlm.vision_hidden_size widens the tower, position_grid sizes the tiny
    Qwen3-VL's learned position grid; a grid the size of the image's patch grid gives every
    patch its own embedding (the interpolation is the identity). The language model keeps its
    draw, and the wider model generates and trains on a visual-maze turn."""
    from safetensors.torch import load_file

    from gyre.models.vision_build import LMSize, create_tiny_vlm

    own = create_tiny_vlm("qwen3_vl", tmp_path / "own", 3, LMSize())
    wide = create_tiny_vlm("qwen3_vl", tmp_path / "w", 3, LMSize(vision_hidden_size=64,
                                                                 position_grid=10))  # fmt: skip
    a, b = load_file(own / "model.safetensors"), load_file(wide / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a if "visual" not in k)
    pos = next(k for k in b if k.endswith("visual.pos_embed.weight"))
    assert a[pos].shape == (64, 32) and b[pos].shape == (100, 64)
    model, _ = load_vlm(wide, torch.device("cpu"))
    visual = model.model.visual
    pixels = torch.zeros(100, 3 * 2 * 16 * 16)  # a 160 x 160 image of 16-px patches
    seen: list[torch.Tensor] = []
    hook = visual.pos_embed.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    with torch.no_grad():
        visual(pixels, grid_thw=torch.tensor([[1, 10, 10]]))
    hook.remove()
    picked = seen[0].reshape(-1, seen[0].shape[-1])  # (100 patches, bilinear corners)
    assert len({int(i) for i in picked[:, 0]}) == 100  # each patch its own embedding
    with pytest.raises(ValueError, match=r"vision_hidden_size"):
        create_tiny_vlm("idefics3", tmp_path / "i", 0, LMSize(vision_hidden_size=64))


def test_vlm_micro_batches_pad_to_their_own_rows_and_sum_to_the_whole(tmp_path):
    """A VLM batch is cut shortest rows first: each micro-batch pads only to its own longest
    row, and the SFT gradient and the recomputed old log-probs equal one whole-batch forward's."""
    from gyre.sft import demonstrations, expand_steps
    from gyre.trainer.batch import collate, micro_batches
    from gyre.trainer.sft import sft_step
    from gyre.trainer.update import prepare_batch

    model, tok = load_vlm(tiny_vlm("qwen3_vl", tmp_path / "vlms"), torch.device("cpu"))
    over = ["env.name=visual_maze", "sft.demos=3", "model.kind=qwen3_vl",
            "rollout.history_turns=0", "train.algo.old_logprobs=recompute",
            "train.algo.skip_zero_advantage=false"]  # fmt: skip
    cfg = load_config(None, over)
    rows, _ = expand_steps(demonstrations(cfg, tmp_path, tok))
    batch = collate(rows, tok.pad_token_id, torch.device("cpu"), vision_of(tok))
    lengths = batch.attention_mask.sum(dim=1)
    assert len(set(lengths.tolist())) > 2  # the opening turn is longer than the others
    sels = micro_batches(batch, 4)
    order = torch.cat(sels)
    assert sorted(order.tolist()) == list(range(len(rows)))
    assert lengths[order].tolist() == sorted(lengths.tolist())
    for sel in sels:
        assert batch.rows(sel).input_ids.shape[1] == int(lengths[sel].max())
        assert len(sel) == 1 or len(sel) * int(lengths[sel].max()) <= 4 * lengths.float().mean()
    assert sum(len(s) * int(lengths[s].max()) for s in sels) < len(rows) * int(lengths.max())

    def grads(size: int) -> tuple[float, list[torch.Tensor]]:
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        loss = sft_step(model, opt, batch, size, max_grad_norm=1e9)["sft/loss"]
        return loss, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    (loss_whole, whole), (loss_micro, micro) = grads(len(rows)), grads(4)
    assert loss_micro == pytest.approx(loss_whole, rel=1e-5)
    for a, b in zip(whole, micro, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    olds = []
    for size in (len(rows), 4):
        cfg.train.micro_batch_size = size
        batch.extras.clear()
        prepare_batch(model, batch, cfg.train)
        olds.append(batch.extras["old_logprobs"])
    torch.testing.assert_close(olds[0], olds[1], rtol=0, atol=1e-5)
    assert (olds[1][batch.loss_mask.bool()] < 0).all()
