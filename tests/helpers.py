"""Test helpers shared by several files (tests/ is put on sys.path by conftest.py)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from gyre.config import AlgoConfig, SamplingConfig, TrainConfig
from gyre.engines.base import EngineFeatures
from gyre.types import Completion, GenerationRequest, SamplingParams


def train_cfg(**overrides: object) -> TrainConfig:
    """A validated ``TrainConfig`` from flat keys: ``train.*`` fields by name, ``train.algo.*``
    fields by name (``old_logprobs=...``), ``train.sampling.*`` ones (``temperature=...``).
    Everything not passed keeps the config default (``mini_batches=4``,
    ``loss_agg='seq-mean-token-mean'``, ``old_logprobs='auto'``, ...), except two that the
    embedded maze default sets for its own sake: the plain update these tests compute by hand
    has ``temperature=1.0`` and ``skip_zero_advantage=False`` unless a test passes them."""
    overrides = {"temperature": 1.0, "skip_zero_advantage": False, **overrides}
    data: dict[str, dict[str, object]] = {"algo": {}, "sampling": {}}
    for key, value in overrides.items():
        if key in AlgoConfig.model_fields:
            data["algo"][key] = value
        elif key in SamplingConfig.model_fields:
            data["sampling"][key] = value
        else:
            data[key] = value  # type: ignore[assignment]
    return TrainConfig.model_validate(data)


@dataclass
class Call:
    sessions: list[Hashable | None]
    prompts: list[list[int]]
    completions: list[Completion]


@dataclass
class RecordingEngine:
    """Engine proxy that records every request and completion.

    ``strip_sessions=True`` forwards requests without a session, so the inner engine can never
    reuse a KV cache (every call is a fresh prefill of the full prompt).
    """

    inner: object
    strip_sessions: bool = False
    features: ClassVar[EngineFeatures] = EngineFeatures()  # lockstep turns: every call is recorded
    calls: list[Call] = field(default_factory=list)
    released: list[Hashable] = field(default_factory=list)

    @property
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, value: int) -> None:
        self.inner.version = value

    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        fwd = [
            GenerationRequest(
                list(r.prompt_ids), None if self.strip_sessions else r.session, seed=r.seed
            )
            for r in requests
        ]
        outs = self.inner.generate(fwd, params)
        self.calls.append(
            Call([r.session for r in requests], [list(r.prompt_ids) for r in requests], outs)
        )
        return outs

    def release(self, sessions: Iterable[Hashable]) -> None:
        sessions = list(sessions)
        self.released.extend(sessions)
        self.inner.release(sessions)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.inner.load_weights(state_dict, version)

    def per_session(self) -> dict[Hashable, list[tuple[list[int], Completion]]]:
        """session -> [(prompt_ids, completion)] in call order."""
        out: dict[Hashable, list[tuple[list[int], Completion]]] = {}
        for call in self.calls:
            for s, p, c in zip(call.sessions, call.prompts, call.completions, strict=True):
                out.setdefault(s, []).append((p, c))
        return out


def dp_batch(model: torch.nn.Module, n: int = 8, seed: int = 0):
    """``n`` trajectories of unequal lengths whose rollout logprobs are ``model``'s own
    (ratio 1), with advantages that sum to zero: a batch for data-parallel update checks."""
    from gyre.trainer.batch import collate, token_logprobs
    from gyre.types import Trajectory

    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        T = 6 + 3 * (i % 4)
        ids = torch.randint(3, 40, (T,), generator=g).tolist()
        mask = [0, 0] + [int(x) for x in (torch.rand(T - 2, generator=g) > 0.3)]
        trajs.append(Trajectory(ids, mask, [0.0] * T, float(i % 2), i // 2, 0, 1, False, i))
    batch = collate(trajs, 0, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch)
    for i, t in enumerate(trajs):
        t.rollout_logprobs = (
            lp[i, : len(t.token_ids)] * batch.loss_mask[i, : len(t.token_ids)]
        ).tolist()
    adv = torch.linspace(-1.0, 1.0, n)
    return trajs, adv


def spawn_two_ranks(target: Callable[..., None], tmp_path: Path, model, tokenizer) -> None:
    """Save ``model`` to ``tmp_path/m`` and run ``target(rank, 2, port, tmp_path, model_dir)``
    on two spawned processes that meet on a free local port (the ranks write their results
    under ``tmp_path``)."""
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp

    mp.start_processes(target, args=(2, port, str(tmp_path), str(tmp_path / "m")),
                       nprocs=2, join=True, start_method="spawn")  # fmt: skip


def dp_rank(rank: int, world: int, port: int, out_dir: str, model_dir: str) -> None:
    """One gloo rank of tests/unit/test_ray_dp.py: for each loss aggregation, update a fresh
    copy of the model on this rank's shard (its own micro-batch size) and save the weights."""
    import torch.distributed as dist

    from gyre.algos import LOSS_AGGREGATIONS
    from gyre.models.build import load_pretrained
    from gyre.trainer.batch import collate
    from gyre.trainer.distributed import TorchCollective
    from gyre.trainer.update import policy_update

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    comm = TorchCollective()
    for agg in LOSS_AGGREGATIONS:
        model, _ = load_pretrained(model_dir, torch.device("cpu"))
        trajs, adv = dp_batch(model)
        rows = len(trajs) // world
        sl = slice(rank * rows, (rank + 1) * rows)
        comm.broadcast_parameters(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        settings = train_cfg(micro_batch_size=1 + rank, loss_agg=agg, max_grad_norm=1e9,
                             mini_batches=1, old_logprobs="rollout")  # fmt: skip
        batch = collate(trajs[sl], 0, torch.device("cpu"))
        policy_update(model, opt, batch, adv[sl], settings, reduce_counts=comm.reduce_counts,
                      sync_grads=comm.sync_gradients)  # fmt: skip
        if rank == 0:
            torch.save(model.state_dict(), f"{out_dir}/dp-{agg}.pt")
    dist.destroy_process_group()


def fsdp2_rank(rank: int, world: int, port: int, out_dir: str, model_dir: str) -> None:
    """One gloo rank of tests/unit/test_fsdp2_cpu.py: gyre's FSDP2 path (``shard_fsdp2`` +
    ``FSDPCollective``) on this rank's half of ``dp_batch``, two SGD steps for each loss
    aggregation; rank 0 saves the gathered full weights and the global losses."""
    import torch.distributed as dist

    from gyre.algos import LOSS_AGGREGATIONS
    from gyre.models.build import load_pretrained
    from gyre.trainer.batch import collate
    from gyre.trainer.distributed import FSDPCollective, shard_fsdp2
    from gyre.trainer.update import policy_update

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    out = {}
    for agg in LOSS_AGGREGATIONS:
        model, _ = load_pretrained(model_dir, torch.device("cpu"))
        trajs, adv = dp_batch(model)
        rows = len(trajs) // world
        sl = slice(rank * rows, (rank + 1) * rows)
        model = shard_fsdp2(model)
        comm = FSDPCollective()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        settings = train_cfg(micro_batch_size=2, loss_agg=agg, max_grad_norm=1e9,
                             mini_batches=1, old_logprobs="rollout")  # fmt: skip
        losses = []
        for _ in range(2):
            batch = collate(trajs[sl], 0, torch.device("cpu"))
            m = policy_update(model, opt, batch, adv[sl], settings,
                              reduce_counts=comm.reduce_counts,
                              sync_grads=comm.sync_gradients)  # fmt: skip
            # each rank's loss is W x its share of the global objective (FSDP2 averages)
            losses.append(float(comm.all_reduce_sum(torch.tensor(m["train/loss"]))))
        state = comm.full_state_dict(model)
        if rank == 0:
            out[agg] = {"state": state, "losses": losses}
    if rank == 0:
        torch.save(out, f"{out_dir}/fsdp2.pt")
    dist.destroy_process_group()


TINY_ARITHMETIC_RUN = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.intermediate_size=64",
    "env.name=arithmetic",
    "env.arithmetic.max_operand=2",
    "env.arithmetic.ops=+",
]
"""CLI overrides of a tiny run on the arithmetic env (2-layer, 32-wide model, operands 0-2)."""


# -- a real-world tokenizer and model, built locally --------------------------------------------

CHATML_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\nYou may call one or more functions."
    "\n\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
"""Qwen2's ChatML chat template (its documented format), with a ``tools`` block."""

_BPE_TEXT = [
    "1+2=3\n",
    "2+2=4\n",
    "0+1=1\n",
    "the quick brown fox jumps over the lazy dog\n",
    "move up, down, left or right until you reach the goal\n\n",
    "What is 12+7? The answer is 19.\n",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi there<|im_end|>\n",
]


def bpe_chat_tokenizer(newline: bool = True, vocab_size: int = 320):
    """A byte-level BPE tokenizer trained here on a few lines of text, as Qwen2's is built:
    ``ByteLevel`` pre-tokenizer and decoder, ``<|endoftext|>`` as EOS and padding,
    ``<|im_start|>`` / ``<|im_end|>`` added special tokens and the ChatML chat template.

    ``newline=False`` trains it without the byte alphabet on text that has no newline, so
    ``"\\n"`` is no token of it (the case of tokenizers whose newline is not one token).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if newline else [],
        show_progress=False,
    )
    text = _BPE_TEXT if newline else [t.replace("\n", " ") for t in _BPE_TEXT]
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_qwen2(tokenizer, seed: int = 0, hidden: int = 32, layers: int = 2):
    """A 2-layer Qwen2 (grouped-query attention, q/k/v biases) over ``tokenizer``'s vocab."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model


def save_qwen2_bpe(path: Path, seed: int = 0, newline: bool = True) -> Path:
    """A tiny Qwen2 + byte-level BPE ChatML tokenizer saved with ``save_pretrained`` to ``path``
    (a folder ``model.path`` / ``gyre serve`` can load)."""
    tok = bpe_chat_tokenizer(newline=newline)
    model = tiny_qwen2(tok, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def spawn_ranks_bounded(target: Callable[..., None], tmp_path: Path, model, tokenizer,
                        timeout_s: float) -> None:  # fmt: skip
    """:func:`spawn_two_ranks`, bounded: ranks still running after ``timeout_s`` (a collective
    waiting on a rank that has finished) are killed and the test fails, never hangs."""
    import time

    import pytest
    import torch.multiprocessing as mp

    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(target, args=(2, port, str(tmp_path), str(tmp_path / "m")),
                             nprocs=2, join=False, start_method="spawn")  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the two ranks did not finish within {timeout_s:.0f} s (deadlock)")


LOCKSTEP_CASES = {  # name -> (collective, train_cfg overrides); rank 0 gets 5 rows, rank 1 gets 3
    "fsdp2-micro": ("fsdp2", {"micro_batch_size": 2, "mini_batches": 1,
                              "old_logprobs": "recompute"}),
    "fsdp2-steps": ("fsdp2", {"micro_batch_size": 2, "mini_batch_size": 2,
                              "old_logprobs": "rollout"}),
    "ddp-steps": ("ddp", {"micro_batch_size": 2, "mini_batch_size": 2,
                          "old_logprobs": "rollout"}),
}  # fmt: skip


def lockstep_rank(rank: int, world: int, port: int, out_dir: str, model_dir: str) -> None:
    """One gloo rank of tests/unit/test_lockstep.py: rank 0 updates on rows 0-4 of ``dp_batch``,
    rank 1 on rows 5-7 (unequal micro-batch and optimizer-step counts), one SGD update per
    case of :data:`LOCKSTEP_CASES`; rank 0 saves the whole weights and each rank's metrics."""
    from datetime import timedelta

    import torch.distributed as dist

    from gyre.models.build import load_pretrained
    from gyre.trainer.batch import collate
    from gyre.trainer.distributed import FSDPCollective, TorchCollective, shard_fsdp2
    from gyre.trainer.update import policy_update, prepare_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    sl = slice(0, 5) if rank == 0 else slice(5, 8)
    out = {}
    for name, (kind, overrides) in LOCKSTEP_CASES.items():
        model, _ = load_pretrained(model_dir, torch.device("cpu"))
        trajs, adv = dp_batch(model)
        model = shard_fsdp2(model) if kind == "fsdp2" else model
        comm = FSDPCollective() if kind == "fsdp2" else TorchCollective()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        settings = train_cfg(loss_agg="token-mean", max_grad_norm=1e9, **overrides)
        batch = collate(trajs[sl], 0, torch.device("cpu"))
        lock = comm.lockstep()
        prepare_batch(model, batch, settings, lockstep=lock)
        m = policy_update(model, opt, batch, adv[sl], settings, generator=torch.Generator(),
                          reduce_counts=comm.reduce_counts, sync_grads=comm.sync_gradients,
                          lockstep=lock)  # fmt: skip
        state = comm.full_state_dict(model)
        out[name] = {"state": state, "metrics": m}
    torch.save(out, f"{out_dir}/lockstep-{rank}.pt")
    dist.destroy_process_group()


def ranks_cfg(run_dir: Path, model_dir: Path | str, ranks: int, *extra: str):
    """A ``runner: ray`` FSDP2 config of the tiny model at ``model_dir`` on ``ranks`` trainer
    ranks (tests/unit/test_resume_ranks.py); only the rank count differs between its runs."""
    from gyre.config import load_config

    return load_config(None, [
        f"model.path={model_dir}", f"run.dir={run_dir}", "runner=ray", "ray.strategy=fsdp2",
        f"ray.trainer_ranks={ranks}", "train.tasks_per_step=4", "train.group_size=2",
        "train.mini_batches=1", "train.lr=0.01", "log.console=off", *extra,
    ])  # fmt: skip


def resume_ranks_rank(rank: int, world: int, port: int, out_dir: str, model_dir: str) -> None:
    """One FSDP2 gloo rank of tests/unit/test_resume_ranks.py: resume the one-process
    checkpoint ``one/.../step_000001`` on two ranks and dump the gathered loaded state; then
    update on this rank's half of ``dp_batch``, dump the gathered state the ranks hold, and
    write a two-rank checkpoint (step 2) under ``two/``."""
    from gyre.checkpoint.resume import Checkpointer
    from gyre.models.build import load_pretrained
    from gyre.trainer.core import Trainer
    from gyre.trainer.fsdp_checkpoint import _indexed, gather

    torch.set_num_threads(1)
    out, cpu = Path(out_dir), torch.device("cpu")
    ckpt1 = out / "one" / "checkpoints" / "step_000001"
    cfg = ranks_cfg(out / "two", model_dir, 2, f"run.resume={ckpt1}")
    if rank == 0:  # the driver's plan, with its config check: 1 rank then, 2 now
        assert Checkpointer(cfg, out / "two").plan().ckpt is not None
    trainer = Trainer.build(cfg, out / "two", ckpt1 / "model", None, cpu,
                            world=(rank, world, f"tcp://127.0.0.1:{port}"))  # fmt: skip
    trainer.restore(ckpt1)
    dumps = {}
    model, optim = gather(trainer.model, trainer.optimizer)
    dumps["loaded"] = (model, _indexed(optim) if rank == 0 else {})
    trajs, _ = dp_batch(load_pretrained(model_dir, cpu)[0])
    trainer.update(2, trajs[:4] if rank == 0 else trajs[4:])  # whole groups: 0-1 and 2-3
    model, optim = gather(trainer.model, trainer.optimizer)
    dumps["held"] = (model, _indexed(optim) if rank == 0 else {})
    trainer.save(Checkpointer(cfg, out / "two"), 2, {}, out / "two" / "metrics.jsonl")
    if rank == 0:
        torch.save(dumps, out / "two-ranks.pt")
    import torch.distributed as dist

    dist.destroy_process_group()


def fsdp2_probe_rank(rank: int, world: int, port: int, out_dir: str, model_dir: str) -> None:
    """One gloo rank of tests/unit/test_ray_probe.py: shard the model with FSDP2 and save the
    sync probe this rank computes for version 1."""
    import torch.distributed as dist

    from gyre.config import load_config
    from gyre.models.build import load_pretrained
    from gyre.runners.probe import with_probe
    from gyre.trainer.distributed import shard_fsdp2

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model, tok = load_pretrained(model_dir, torch.device("cpu"))
    model = shard_fsdp2(model)
    probe = with_probe(load_config(None, []), {}, model, tok, 1)
    torch.save(probe, f"{out_dir}/probe{rank}.pt")
    dist.destroy_process_group()
