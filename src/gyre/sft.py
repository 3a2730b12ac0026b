"""The SFT warm start: supervised fine-tuning on noisy-expert demonstrations, resumable.

The demonstrations come from the env's own demonstrator (``gyre.rollout.episodes.demonstrate``)
on training seeds; the run writes ``<run.dir>/sft/`` and ``sft_metrics.jsonl``. Every runner runs
it in its own (driver) process before GRPO.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyre.checkpoint.resume import (
    Checkpointer,
    Preempted,
    ResumePlan,
    StopGuard,
    TaskCursor,
    cached,
    check_nonfinite,
    check_parameters_finite,
    preempt_if_requested,
    rewind_metrics,
)
from gyre.checkpoint.snapshot import Snapshot, load_into
from gyre.checkpoint.store import write_model_dir
from gyre.config import Config
from gyre.envs import Demonstrator, env_factory
from gyre.envs.record import trained_on
from gyre.models.build import load_pretrained
from gyre.models.vision import freeze_vision, vision_of
from gyre.rollout.core import STREAM_SFT, run_stops
from gyre.rollout.demonstrate import demonstrate
from gyre.rollout.evaluate import train_seed, validation_seeds
from gyre.rollout.tools import message_mode
from gyre.rollout.window import window_of
from gyre.telemetry import ConsoleSink, JsonlSink, MetricsSink, MultiSink
from gyre.trainer.batch import TokenBatch, collate
from gyre.trainer.schedule import build_scheduler
from gyre.trainer.sft import sft_step, sft_validate
from gyre.trainer.stepwise import expand_steps
from gyre.types import Trajectory


def demonstrations(
    cfg: Config, run_dir: Path, tokenizer: Any, stop: Callable[[], bool] | None = None
) -> list[Trajectory]:
    """``sft.demos`` noisy-expert episodes on the SFT task stream, cached in ``sft_demos.pt``
    under a key of everything they depend on (rebuilt when any of it changes). Every answer
    ends with the token the rollout stops at (:attr:`gyre.rollout.stops.Stops.terminator`).
    A message-mode env's demonstrations are rendered with the chat template (and a VLM's image
    side) exactly as its rollout renders them (:func:`gyre.rollout.episodes.demonstrate`).
    ``stop``: asked before each demonstration; when it says so, :class:`DemosStopped` is raised
    and nothing is cached (image envs take minutes to play thousands)."""
    play, vision = _Player(cfg, tokenizer), vision_of(tokenizer)
    rng = np.random.default_rng([cfg.run.seed, STREAM_SFT])
    key = {
        "seed": cfg.run.seed,
        "env": cfg.env.model_dump(),
        "n": cfg.sft.demos,
        "noise": cfg.sft.noise,
        "vocab": tokenizer.get_vocab(),
        "successful_only": cfg.sft.successful_only,
        "terminator": list(play.terminator),
    }
    if cfg.rollout.history_turns is not None:  # each demonstration's turn samples
        key["window"] = [cfg.rollout.history_turns, cfg.rollout.keep_opening]
    if play.chat is not None:  # the rendering depends on the template, the limits, the image side
        key["chat"] = {
            "template": tokenizer.chat_template,
            "rollout": cfg.rollout.model_dump(),
            "images": vision.image_processor.to_dict() if vision else None,
        }
    demos = cached(
        run_dir / "sft_demos.pt",
        key,
        lambda: _pack_images(
            _demos(
                lambda k: play(train_seed(cfg.run.seed, STREAM_SFT, k), cfg.sft.noise, rng),
                cfg.sft.demos,
                cfg.sft.successful_only,
                stop,
            )
        ),
    )
    return _unpack_images(demos)


class _Player:
    """Plays one demonstration of the run's env, tokenised as its rollout would be."""

    def __init__(self, cfg: Config, tokenizer: Any) -> None:
        self.make_env, self.chat, toolbox = message_mode(cfg, tokenizer, env_factory(cfg.env))
        if toolbox is not None:
            toolbox.close()
            raise ValueError(
                "rollout.tools: gyre's demonstrators do not call tools, so SFT cannot warm-start "
                f"a tool run: set sft.steps=0 (it is {cfg.sft.steps})"
            )
        if not isinstance(self.make_env(), Demonstrator):
            raise ValueError(
                f"env.name={cfg.env.name!r} has no demonstrator (expert_action / random_action), "
                f"so SFT cannot warm-start on it: set sft.steps=0 (it is {cfg.sft.steps})"
            )
        self.tokenizer = tokenizer
        self.terminator = run_stops(cfg, tokenizer, self.chat).terminator
        self.window = window_of(cfg.rollout)

    def __call__(self, seed: int, noise: float, rng: np.random.Generator) -> Trajectory:
        return demonstrate(
            self.make_env,
            self.tokenizer,
            seed,
            noise,
            rng,
            terminator=self.terminator,
            chat=self.chat,
            window=self.window,
        )


def validation_demos(cfg: Config, tokenizer: Any) -> list[Trajectory]:
    """``sft.validation_demos`` demonstrations without noise on the validation seeds (never
    trained on, never the held-out evaluation's), for :func:`gyre.trainer.sft.sft_validate`."""
    play = _Player(cfg, tokenizer)
    rng = np.random.default_rng([cfg.run.seed, STREAM_SFT, 2])  # a mixed teacher draws from it
    return [play(seed, 0.0, rng) for seed in validation_seeds(cfg.sft.validation_demos)]


MAX_TRIES_PER_DEMO = 20  # sft.successful_only: tries per kept demonstration before giving up


class DemosStopped(Exception):
    """A stop signal arrived while the SFT demonstrations were being played."""


def _demos(
    play: Callable[[int], Trajectory],
    n: int,
    successful_only: bool,
    stop: Callable[[], bool] | None = None,
) -> list[Trajectory]:
    """Demonstrations 0, 1, .. of the SFT stream: the first ``n``, or with ``successful_only``
    the first ``n`` that succeed (at most ``MAX_TRIES_PER_DEMO`` x ``n`` played)."""

    def one(k: int) -> Trajectory:
        if stop is not None and stop():
            raise DemosStopped(f"stopped after {k} of the SFT demonstrations")
        return play(k)

    if not successful_only:
        return [one(k) for k in range(n)]
    kept: list[Trajectory] = []
    for k in range(MAX_TRIES_PER_DEMO * n):
        demo = one(k)
        if demo.success:
            kept.append(demo)
            if len(kept) == n:
                return kept
    raise ValueError(
        f"sft.successful_only: {len(kept)} of {MAX_TRIES_PER_DEMO * n} demonstrations succeeded, "
        f"fewer than sft.demos={n}; lower sft.noise or sft.demos, or set successful_only=false"
    )


def _pack_images(demos: list[Trajectory]) -> list[Trajectory]:
    """Each demonstration's images as PNG bytes (lossless) for the cache file: raw arrays of an
    image env's 2,000 demonstrations take hundreds of MB, their PNGs a few MB. An image held by
    an episode and by its step-wise samples is encoded once."""
    if not any(d.images for d in demos):
        return demos
    from PIL import Image

    done: dict[int, bytes] = {}  # id(array) -> PNG: every array stays alive in ``demos``

    def png(img: np.ndarray) -> bytes:
        if id(img) not in done:
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="PNG")
            done[id(img)] = buf.getvalue()
        return done[id(img)]

    return [_map_images(d, png) for d in demos]


def _unpack_images(demos: list[Trajectory]) -> list[Trajectory]:
    """:func:`_pack_images` undone: the images back as HxWx3 uint8 arrays, bit for bit. Equal
    PNGs decode to one shared (read-only) array: an episode and its step-wise samples hold the
    same frames, and a maze's pictures repeat across demonstrations (an egocentric view of the
    same cell), so decoding each occurrence kept several copies of every frame in memory."""
    if not any(d.images and isinstance(d.images[0], bytes) for d in demos):
        return demos
    from PIL import Image

    decoded: dict[bytes, np.ndarray] = {}

    def arr(png: bytes) -> np.ndarray:
        got = decoded.get(png)
        if got is None:
            got = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
            got.flags.writeable = False
            decoded[png] = got
        return got

    return [_map_images(d, arr) for d in demos]


def _map_images(d: Trajectory, fn: Callable[[Any], Any]) -> Trajectory:
    """``d`` with ``fn`` applied to its images and to its step-wise samples' images."""
    steps = [replace(s, images=[fn(im) for im in s.images]) for s in d.steps] if d.steps else None
    return replace(d, images=[fn(im) for im in d.images], steps=steps)


def run_sft(
    cfg: Config,
    run_dir: Path,
    device: torch.device,
    base: Path,
    ckpt: Checkpointer | None = None,
    resume: ResumePlan | None = None,
    guard: StopGuard | None = None,
) -> Path:
    """Supervised warm start on noisy-expert demonstrations; writes ``<run.dir>/sft/``.

    Resumable: every ``checkpoint.sft_every`` steps (and on a stop signal) the model,
    optimizer, LR scheduler, data cursor and RNGs go to an ``sft_NNNNNN`` checkpoint.
    """
    out_dir = run_dir / "sft"
    metrics_path = run_dir / "sft_metrics.jsonl"
    ckpt = ckpt or Checkpointer(cfg, run_dir)
    resuming = resume is not None and resume.phase == "sft" and resume.ckpt is not None
    model, tokenizer = load_pretrained(resume.ckpt / "model" if resuming else base, device)
    if cfg.model.freeze_vision:
        freeze_vision(model)  # a VLM's tower and projector, as in GRPO (nothing for text models)
    try:
        stop = (lambda: guard.requested) if guard is not None else None
        demos = demonstrations(cfg, run_dir, tokenizer, stop)
    except DemosStopped as exc:  # nothing trained in this process: the last checkpoint stands
        assert guard is not None
        where = str(resume.ckpt) if resuming and resume is not None else "none yet"
        raise Preempted(guard.signame or "signal", "sft demonstrations", 0, where) from exc
    val = _validation_batch(cfg, tokenizer, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.sft.lr, weight_decay=0.0)
    sft = cfg.sft
    sched = build_scheduler(opt, sft.warmup_steps, sft.steps, sft.lr_schedule, sft.min_lr_ratio)
    cursor = TaskCursor(len(demos), np.random.default_rng([cfg.run.seed, STREAM_SFT, 1]))
    start, streak = 0, 0
    if resuming:
        assert resume is not None and resume.ckpt is not None
        state = load_into(resume.ckpt, opt, sched)
        cursor.load_state_dict(state["data"])
        start, streak = int(state["step"]), int(state.get("nonfinite_streak", 0))
        rewind_metrics(metrics_path, int(state["metrics_offset"]))
    else:
        rewind_metrics(metrics_path, 0)
    sinks: list[MetricsSink] = [JsonlSink(metrics_path)]
    if cfg.log.console != "off":
        sinks.append(ConsoleSink(cfg.sft.steps, cfg.log.console, "SFT"))
    sink = MultiSink(*sinks)

    def save(step: int) -> str | None:
        state = {"data": cursor.state_dict(), "nonfinite_streak": streak}
        snap = Snapshot(step, state, opt, sched, phase="sft")
        return ckpt.save(model, tokenizer, snap, metrics_path)

    try:
        for step in range(start + 1, cfg.sft.steps + 1):
            idx = cursor.take(cfg.sft.batch_size)
            rows, _ = expand_steps([demos[i] for i in idx])  # rollout.history_turns: turns
            batch = collate(rows, tokenizer.pad_token_id, device, vision_of(tokenizer))
            lr = opt.param_groups[0]["lr"]
            metrics = sft_step(
                model, opt, batch, cfg.train.micro_batch_size, cfg.train.max_grad_norm
            )
            sched.step()
            streak = streak + 1 if metrics["sft/nonfinite_skipped"] else 0
            if val is not None and _validate_now(cfg, step):
                metrics.update(sft_validate(model, val, cfg.train.micro_batch_size))
            sink.log(step, {**metrics, "sft/lr": lr})
            check_nonfinite(cfg, streak, "SFT", step)
            check_parameters_finite(model, "SFT", step)
            saved = None
            every = cfg.checkpoint.sft_every
            if every and step % every == 0 and step < cfg.sft.steps:
                saved = save(step)
            preempt_if_requested(guard, "sft", step, saved, lambda s=step: save(s))
    finally:
        sink.close()
    write_model_dir(out_dir, model, tokenizer, trained_on(cfg))
    ckpt.drop_sft()
    return out_dir


def _validation_batch(cfg: Config, tokenizer: Any, device: torch.device) -> TokenBatch | None:
    if not cfg.sft.validation_demos:
        return None
    rows, _ = expand_steps(validation_demos(cfg, tokenizer))
    return collate(rows, tokenizer.pad_token_id, device, vision_of(tokenizer))


def _validate_now(cfg: Config, step: int) -> bool:
    every = cfg.sft.validation_every
    return step == cfg.sft.steps or (every > 0 and step % every == 0)
