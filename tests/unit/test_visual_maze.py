"""visual_maze: the text maze's rules seen as images; its gymnasium twin; frame strips."""

from __future__ import annotations

import base64
import importlib
import io
import sys

import numpy as np
import pytest

from gyre.config import ConfigError, load_config
from gyre.envs import env_factory
from gyre.envs.base import Demonstrator, MessageEnv, is_message_env
from gyre.envs.maze import MOVES, MazeEnv, Teacher
from gyre.envs.visual_maze import COLOURS, Drawing, VisualMazeEnv, render_maze
from gyre.telemetry.frames import (
    frame_strip,
    message_images,
    png_data_uri,
    replay_frames,
    strip_captions,
)

Image = pytest.importorskip("PIL.Image")
HELD_OUT = 2**31  # the evaluation seeds start here (docs/envs.md)


def _make(*overrides: str):
    cfg = load_config(None, ["env.name=visual_maze", *overrides])
    return env_factory(cfg.env)


def _pixels(msgs) -> np.ndarray:
    (img,) = message_images(msgs)
    return np.asarray(img)


def _text(msgs) -> str:
    parts = msgs[0]["content"]
    assert [p["type"] for p in parts] == ["image", "text"]
    return parts[1]["text"]


def _play(env, seed: int, noise: float, rng_seed: int):
    """One demonstrator episode (noisy expert): the (action, reward, done, info) of each move."""
    rng = np.random.default_rng(rng_seed)
    env.reset(seed)
    out = []
    while True:
        a = env.random_action(rng) if rng.random() < noise else env.expert_action(rng)
        _, r, done, info = env.step(a)
        out.append((a, r, done, info))
        if done:
            return out


def _expected_colour(maze: MazeEnv, r: int, c: int, draw_visited: bool = True):
    if (r, c) == maze.pos:
        return COLOURS["agent"]
    if maze.walls[r, c]:
        return COLOURS["wall"]
    if (r, c) == maze.goal:
        return COLOURS["goal"]
    if draw_visited and (r, c) in maze.visited:
        return COLOURS["visited"]
    return COLOURS["free"]


# -- the protocol and the messages ------------------------------------------------------------
def test_is_a_message_env_with_a_demonstrator_and_image_parts():
    env = _make()()
    assert is_message_env(env) and isinstance(env, MessageEnv) and isinstance(env, Demonstrator)
    msgs = env.reset(3)
    assert len(msgs) == 1 and msgs[0]["role"] == "user"
    img = msgs[0]["content"][0]["image"]
    assert isinstance(img, Image.Image) and img.mode == "RGB" and img.size == (84, 84)
    assert f"at most {env.maze.budget} moves" in _text(msgs)


def test_pixels_are_deterministic_per_seed():
    make = _make()
    for seed in (0, 7, HELD_OUT + 3):
        a, b = make(), make()
        frames_a = [_pixels(a.reset(seed))]
        frames_b = [_pixels(b.reset(seed))]
        for move in "uurdlx":
            frames_a.append(_pixels(a.step(move)[0]))
            frames_b.append(_pixels(b.step(move)[0]))
            if a.maze.done:
                break
        assert all(np.array_equal(x, y) for x, y in zip(frames_a, frames_b, strict=True))
    # and the seed matters: distinct mazes give distinct pictures
    firsts = {_pixels(make().reset(s)).tobytes() for s in range(20)}
    assert len(firsts) == 20


@pytest.mark.parametrize(
    "cell_px,pad_to,size,draw_visited",
    [(14, 28, 5, True), (16, 32, 7, True), (14, 0, 6, False), (5, 0, 5, True)],
)
def test_cells_are_drawn_in_their_colours(cell_px, pad_to, size, draw_visited):
    env = VisualMazeEnv(
        MazeEnv(size=size), Drawing(cell_px=cell_px, pad_to=pad_to, draw_visited=draw_visited)
    )
    rng = np.random.default_rng(0)
    for seed in range(6):
        frames = [_pixels(env.reset(seed))]
        checked = 0
        while True:
            maze = env.maze
            img = frames[-1]
            side = size * cell_px
            want = -(-side // pad_to) * pad_to if pad_to else side
            assert img.shape == (want, want, 3) == (env.image_side, env.image_side, 3)
            for r in range(size):
                for c in range(size):
                    centre = img[r * cell_px + cell_px // 2, c * cell_px + cell_px // 2]
                    assert tuple(centre) == _expected_colour(maze, r, c, draw_visited), (r, c)
                    checked += 1
            if want > side:  # the padding reads as wall
                assert (img[side:] == COLOURS["wall"]).all() and (
                    img[:, side:] == COLOURS["wall"]
                ).all()
            if maze.done:
                break
            frames.append(_pixels(env.step(env.random_action(rng))[0]))
        assert checked >= size * size


@pytest.mark.parametrize(
    "size,radius,cell_px,pad_to", [(5, 0, 8, 16), (6, 2, 14, 28), (5, 1, 5, 0)]
)
def test_agent_view_is_the_grid_shifted_to_the_agent(size, radius, cell_px, pad_to):
    """view=agent: window cell (i, j) shows grid cell (r - k + i, c - k + j) for the agent at
    (r, c), walls outside the grid; the agent always sits in the centre cell."""
    env = VisualMazeEnv(
        MazeEnv(size=size), Drawing(cell_px=cell_px, pad_to=pad_to, view="agent", radius=radius)
    )
    k = radius or size - 1
    n = 2 * k + 1
    want = -(-n * cell_px // pad_to) * pad_to if pad_to else n * cell_px
    rng = np.random.default_rng(1)
    for seed in range(5):
        img = _pixels(env.reset(seed))
        while True:
            maze = env.maze
            assert img.shape == (want, want, 3) == (env.image_side, env.image_side, 3)
            pr, pc = maze.pos
            for i in range(n):
                for j in range(n):
                    r, c = pr - k + i, pc - k + j
                    inside = 0 <= r < size and 0 <= c < size
                    expect = _expected_colour(maze, r, c) if inside else COLOURS["wall"]
                    centre = img[i * cell_px + cell_px // 2, j * cell_px + cell_px // 2]
                    assert tuple(centre) == expect, (seed, i, j)
            if maze.done:
                break
            img = _pixels(env.step(env.random_action(rng))[0])
    # the rules are untouched: the same moves give the grid view's rewards
    grid = VisualMazeEnv(MazeEnv(size=size), Drawing(cell_px=cell_px, pad_to=pad_to))
    assert "centred on you" in _text(env.reset(3)) and "centred" not in _text(grid.reset(3))
    for move in "uulrddx":
        assert env.step(move)[1:] == grid.step(move)[1:]
    with pytest.raises(ValueError, match="view"):
        Drawing(view="ego")
    with pytest.raises(ConfigError, match=r"env\.visual_maze\.view"):
        load_config(None, ["env.name=visual_maze", "env.visual_maze.view=ego"])
    ego = _make(
        "env.visual_maze.view=agent", "env.visual_maze.cell_px=8", "env.visual_maze.pad_to=16"
    )()
    assert _pixels(ego.reset(0)).shape == (80, 80, 3)


def test_agent_on_the_goal_shows_both():
    env = _make()()
    env.reset(4)
    rng = np.random.default_rng(0)
    while True:
        msgs, r, done, info = env.step(env.expert_action(rng))
        if done:
            break
    assert info["success"] and r == 1.0 and _text(msgs) == "You reached the goal."
    img, (gr, gc), px = _pixels(msgs), env.maze.goal, env.drawing.cell_px
    assert tuple(img[gr * px + px // 2, gc * px + px // 2]) == COLOURS["agent"]
    assert tuple(img[gr * px, gc * px]) == COLOURS["goal"]  # the cell's corner


def test_grid_lines_leave_cell_centres_alone():
    plain = VisualMazeEnv(drawing=Drawing(grid_lines=False))
    lined = VisualMazeEnv(drawing=Drawing(grid_lines=True))
    a, b = _pixels(plain.reset(2)), _pixels(lined.reset(2))
    assert not np.array_equal(a, b)
    assert tuple(b[0, 0]) == COLOURS["line"]
    centres = np.ix_(np.arange(7, 70, 14), np.arange(7, 70, 14))
    assert np.array_equal(a[centres], b[centres])


# -- the rules are the text maze's ----------------------------------------------------------------
def test_every_maze_setting_reaches_the_inner_maze():
    overrides = ["env.maze.size=7", "env.maze.wall_density=0.2", "env.maze.min_distance=6"]
    overrides += ["env.maze.budget_factor=1.5", "env.maze.view=2", "env.maze.observation=exits"]
    visual = _make(*overrides)()
    text = env_factory(load_config(None, ["env.name=maze", *overrides]).env)()
    fields = load_config(None, overrides).env.maze.model_dump()
    assert fields["size"] == 7 and fields["observation"] == "exits"

    def setting(maze: MazeEnv, name: str) -> object:
        teacher = {"demonstrator": maze.teacher.name, "demonstrator_mix": maze.teacher.mix}
        return teacher[name] if name in teacher else getattr(maze, name)

    for name in fields:  # each env.maze.* field is a MazeEnv setting (the teacher's: its Teacher)
        assert setting(visual.maze, name) == setting(text, name) == fields[name], name


def test_same_moves_same_rewards_as_the_text_maze():
    cfg = load_config(
        None, ["env.name=visual_maze", "env.maze.size=6", "env.maze.budget_factor=1.5"]
    )
    m = cfg.env.maze
    visual = env_factory(cfg.env)()
    text = MazeEnv(
        m.size, m.wall_density, m.min_distance, m.budget_factor, teacher=Teacher(m.demonstrator)
    )
    for seed in [*range(40), *range(HELD_OUT, HELD_OUT + 10)]:
        ep_v = _play(visual, seed, noise=0.4, rng_seed=seed)
        ep_t = _play(text, seed, noise=0.4, rng_seed=seed)
        assert ep_v == ep_t, seed  # same actions, rewards, done flags and info (state included)
        assert visual.state_key() == text.state_key()


def test_demonstrator_success_rate_equals_the_text_maze():
    visual, text = _make("env.maze.demonstrator=shortest")(), MazeEnv()
    for noise in (0.0, 0.5):
        rates = []
        for env in (visual, text):
            wins = [_play(env, s, noise, rng_seed=1000 + s)[-1][3]["success"] for s in range(150)]
            rates.append(sum(wins) / len(wins))
        assert rates[0] == rates[1]
        assert rates[0] == 1.0 if noise == 0.0 else 0.2 < rates[0] < 1.0


def test_feedback_text():
    env = _make()()
    env.reset(5)  # the agent starts at (4, 0): a wall to its right, open above (hand-checked)
    assert env.maze.pos == (4, 0) and env.maze.walls[4, 1] and not env.maze.walls[3, 0]
    budget = env.maze.budget
    assert _text(env.step("r")[0]) == f"A wall right: you did not move. {budget - 1} moves left."
    assert (
        _text(env.step("hello")[0]) == f"Not a move: reply u, d, l or r. {budget - 2} moves left."
    )
    msgs, _, _, info = env.step(" UP ")
    assert _text(msgs) == f"You moved up. {budget - 3} moves left." and info["state"] == (3, 0)
    quiet = _make("env.visual_maze.feedback=false")()
    quiet.reset(5)
    assert _text(quiet.step("r")[0]) == f"{budget - 1} moves left."


def test_text_observation_adds_the_text_mazes_view():
    env = _make("env.visual_maze.text_observation=true", "env.maze.observation=grid")()
    first = _text(env.reset(5))
    assert first.endswith(env.maze.render())
    assert _text(env.step("u")[0]).endswith(env.maze.render())


def test_describe_replies_say_what_the_picture_shows_then_move():
    """env.visual_maze.describe: the demonstrator's reply is the text maze's line then the
    move; only the last word acts, so a wrong line with the right move still moves, and an
    episode plays exactly as the plain env's with the bare moves."""
    over = ("env.maze.observation=compass", "env.maze.view=1", "env.maze.demonstrator=careful")
    env, plain = _make("env.visual_maze.describe=true", *over)(), _make(*over)()
    assert "Say what you see" in _text(env.reset(5)) and "Reply with one move" in _text(
        plain.reset(5)
    )
    rng, rng_plain = np.random.default_rng(0), np.random.default_rng(0)
    done = False
    while not done:
        line = env.maze.render().strip()
        reply, move = env.expert_action(rng), plain.expert_action(rng_plain)
        assert reply == f"{line} {move}" and len(line) == 9  # u d l r cells, the goal's offset
        got, want = env.step(reply), plain.step(move)
        assert got[1:] == want[1:] and _text(got[0]) == _text(want[0])
        done = got[2]
    env.reset(5)
    wall_line = "#### u9r9>"  # wrong about everything but the move
    assert env.step(f"{wall_line} u")[3]["state"] == (3, 0)  # seed 5: open above (4, 0)
    assert env.step("")[3]["malformed"] and env.random_action(rng).split()[0] == env.description()


def test_config_builds_and_bounds():
    env = _make("env.maze.size=7", "env.visual_maze.cell_px=16", "env.visual_maze.pad_to=32")()
    assert env.maze.size == 7 and _pixels(env.reset(0)).shape == (128, 128, 3)
    with pytest.raises(ConfigError, match=r"env\.visual_maze\.cell_px"):
        load_config(None, ["env.name=visual_maze", "env.visual_maze.cell_px=1"])
    with pytest.raises(ConfigError, match=r"env\.kwargs"):
        load_config(None, ["env.name=visual_maze", "env.kwargs={size: 5}"])
    with pytest.raises(ValueError, match="cell_px"):
        Drawing(cell_px=0)


def test_default_image_needs_no_resize_by_qwen_vl_processors():
    """pad_to=28 (32) makes the side a multiple of the merge unit: the Qwen2-VL image processor
    (patch 14; patch 16 as Qwen3-VL) keeps it as it is, one patch per cell."""
    qwen = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    for cell_px, unit in ((14, 28), (16, 32)):
        proc = qwen.Qwen2VLImageProcessorPil(patch_size=cell_px, merge_size=2)
        for size in range(5, 10):
            env = VisualMazeEnv(MazeEnv(size=size), Drawing(cell_px=cell_px, pad_to=unit))
            side = env.image_side
            assert qwen.smart_resize(side, side, factor=unit) == (side, side)
            out = proc(images=message_images(env.reset(size)), return_tensors="np")
            patches = side // cell_px
            assert out["image_grid_thw"].tolist() == [[1, patches, patches]]


# -- gymnasium ----------------------------------------------------------------------------------
def test_gymnasium_registration():
    gym = pytest.importorskip("gymnasium")
    from gymnasium.utils.env_checker import check_env

    import gyre.envs.gym_visual as gv

    env = gym.make("gyre/VisualMaze-v0", render_mode="rgb_array")
    check_env(env.unwrapped, skip_render_check=False)  # gymnasium's own API conformance checks
    assert env.observation_space.shape == (84, 84, 3) and env.action_space.n == 4
    obs, info = env.reset(seed=5)
    visual = VisualMazeEnv()
    assert np.array_equal(obs, _pixels(visual.reset(5))) and info["budget"] == visual.maze.budget
    assert np.array_equal(env.render(), obs)
    rng = np.random.default_rng(0)
    while True:  # the expert's moves through Discrete(4): the same frames as the message env
        move = visual.expert_action(rng)
        obs, r, term, trunc, _ = env.step(gv.ACTION_MOVES.index(move))
        msgs, r_v, done, _ = visual.step(move)
        assert np.array_equal(obs, _pixels(msgs)) and r == r_v
        if done:
            break
    assert term and not trunc and r == 1.0
    env.reset(seed=5)
    for _ in range(visual.maze.budget):  # bumping into the wall on its right, all budget long
        _, r, term, trunc, _ = env.step(gv.ACTION_MOVES.index("r"))
    assert (r, term, trunc) == (0.0, False, True)
    via_module = gym.make("gyre.envs.gym_visual:gyre/VisualMaze-v0", cell_px=16, pad_to=32)
    assert via_module.observation_space.shape == (96, 96, 3)
    ego = gym.make("gyre/VisualMaze-v0", cell_px=8, pad_to=16, view="agent")
    ego_env = VisualMazeEnv(drawing=Drawing(cell_px=8, pad_to=16, view="agent"))
    assert np.array_equal(ego.reset(seed=2)[0], _pixels(ego_env.reset(2)))
    assert np.array_equal(ego.step(0)[0], _pixels(ego_env.step("u")[0]))
    with pytest.raises(ValueError, match="Discrete"):
        env.unwrapped.step(4)


def test_gymnasium_missing_says_which_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "gyre.envs.gym_visual", raising=False)
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # as if the extra were not installed
    with pytest.raises(ImportError, match=r"pip install 'gyre\[gymnasium\]'"):
        importlib.import_module("gyre.envs.gym_visual")


# -- frame strips ---------------------------------------------------------------------------------
def test_replay_frames_and_the_strip():
    env = _make()()
    actions = ["u", "u", "oops", "u", "u", "r", "l"]  # the episode ends at "r" (the goal)
    frames = replay_frames(env, 5, actions)
    assert len(frames) == 7  # the opening frame and one per move up to the end
    assert np.array_equal(np.asarray(frames[-1]), env.pixels())
    caps = strip_captions(actions[:6])
    assert caps == ["start", "1 u", "2 u", "3 oops", "4 u", "5 u", "6 r"]
    png = frame_strip(frames, caps, scale=2, gap=3)
    strip = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    w = 84 * 2
    assert strip.shape == (w + 12, 7 * w + 6 * 3, 3)
    for k, f in enumerate(frames):
        x = k * (w + 3)
        assert np.array_equal(strip[:w:2, x : x + w : 2], np.asarray(f)), k
        assert (strip[:w, x + w : x + w + 3] == 255).all() if k < 6 else True
        assert (strip[w:, x : x + w] < 128).any()  # a caption is written under every frame
    assert png == frame_strip(frames, caps, scale=2, gap=3)  # deterministic bytes
    uri = png_data_uri(png)
    assert uri.startswith("data:image/png;base64,") and base64.b64decode(uri[22:]) == png
    short = np.asarray(Image.open(io.BytesIO(frame_strip(frames, max_frames=3))))
    assert short.shape == (84, 3 * 84 + 2 * 2, 3)
    assert np.array_equal(short[:, -84:], np.asarray(frames[-1]))
    with pytest.raises(ValueError, match="7 frames but 2 captions"):
        frame_strip(frames, ["a", "b"])
    with pytest.raises(ValueError, match="at least one frame"):
        frame_strip([])


def test_render_maze_is_the_envs_picture():
    env = VisualMazeEnv()
    msgs = env.reset(9)
    assert np.array_equal(render_maze(env.maze), _pixels(msgs))
    assert set(MOVES) == {"u", "d", "l", "r"}


# -- the messages through gyre's chat rollout, with the tiny Qwen2.5-VL -------------------------
@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    """The tiny built-in Qwen2.5-VL's tokenizer (its VisionIO attached) and chat template."""
    import torch

    from gyre.models.vision import load_vlm, vision_of
    from gyre.rollout.chat import ChatTemplate
    from vision_helpers import tiny_vlm

    folder = tiny_vlm("qwen2_5_vl", tmp_path_factory.getbasetemp() / "vlms")
    _, tok = load_vlm(folder, torch.device("cpu"))
    assert vision_of(tok) is not None
    return tok, ChatTemplate(tok)


def test_an_episode_renders_through_the_chat_rollout_with_a_vision_template(qwen_vl):
    """What a VLM rollout renders: one image per observation, each placeholder expanded into
    the image's run of image tokens, the feedback text, the replies as sampled; prefix-stable,
    so the episode's text is the template's own."""
    from gyre.models.vision import vision_of
    from gyre.rollout.chat import ChatEpisode
    from gyre.types import Completion

    tok, tpl = qwen_vl
    vision = vision_of(tok)
    env, rng = _make()(), np.random.default_rng(3)
    ep = ChatEpisode(tpl)
    ids = ep.start(env.reset(11))
    texts, turns = [], 0
    while True:
        move = env.random_action(rng) if turns == 1 else env.expert_action(rng)
        out = [*tpl.encode(move), tpl.end_id]
        ids += out
        reply = ep.reply(Completion(out, [0.0] * len(out), "stop"))
        assert reply == move
        new, _, done, _ = env.step(reply)
        turns += 1
        if done:
            break
        texts.append(_text(new))
        ids += ep.observe(new)
    ids += ep.close()
    assert not ep.drift
    assert ep.text.count("<|image_pad|>") == turns == len(ep.images) == len(message_images(ep.conv))
    for t in [env.intro(), *texts]:
        assert f"<|vision_start|><|image_pad|><|vision_end|>{t}<|im_end|>" in ep.text
    per_image = vision.num_tokens(ep.images[0])
    assert per_image > 1  # the placeholder became the image's full run of tokens
    assert ids.count(vision.image_token_id) == turns * per_image
    vision.check(ids, ep.images, "episode")
    assert ids == vision.expand(ep.text, ep.images)  # the whole rendering, expanded at once


def test_run_episodes_plays_the_visual_maze_in_message_mode(qwen_vl):
    """gyre's rollout (run_episodes, message mode) with the expert's replies scripted: every
    episode reaches the goal in the shortest number of moves, as the text maze says it must."""
    from chat_helpers import ScriptedEngine
    from gyre.models.vision import vision_of
    from gyre.rollout.chat import ChatMode
    from gyre.rollout.episodes import run_episodes
    from gyre.types import SamplingParams

    tok, tpl = qwen_vl
    vision = vision_of(tok)
    make, seed = _make(), 11
    text_maze = MazeEnv()
    expert = [a for a, *_ in _play(text_maze, seed, noise=0.0, rng_seed=0)]
    goal = text_maze.goal
    assert len(expert) == text_maze.shortest
    engine = ScriptedEngine(tok, expert, tpl.end_id)
    trajs = run_episodes(make, engine, tok, [seed], 2, SamplingParams(), chat=ChatMode(tpl))
    assert len(trajs) == 2
    for t in trajs:
        assert t.success and t.reward == 1.0 and t.num_turns == len(expert)
        assert t.info["state"] == goal  # the GiGPO key of the last move: the goal's cell
        assert len(t.images) == len(expert)  # one image per observation shown
        vision.check(t.token_ids, t.images, "trajectory")
        assert t.token_ids.count(vision.image_token_id) == len(expert) * vision.num_tokens(
            t.images[0]
        )
        frames = replay_frames(make(), seed, expert)
        for shown, frame in zip(t.images, frames, strict=False):  # the env's own pixels
            assert np.array_equal(shown, np.asarray(frame))
        sampled = [i for i, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
        assert tok.decode(sampled) == "<|im_end|>".join(expert) + "<|im_end|>"
