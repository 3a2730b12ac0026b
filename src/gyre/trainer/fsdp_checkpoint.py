"""Checkpoints of an FSDP2-sharded trainer that hold the whole model.

Under ``ray.strategy: fsdp2`` each rank holds 1/W of every parameter and of its AdamW moments.
A checkpoint written from rank 0's own tensors would hold rank 0's shard only, so it is written
from a *gathered* state instead:

1. every rank joins ``torch.distributed.checkpoint.state_dict.get_state_dict`` with
   ``full_state_dict=True, cpu_offload=True`` (a collective): rank 0 receives the whole model
   and the whole optimizer state on its CPU, the other ranks nothing;
2. rank 0 copies the model into its *mirror* -- a plain CPU copy of the model taken before
   ``fully_shard`` (:func:`make_mirror`) -- and writes the usual checkpoint from it through the
   run's :class:`~gyre.checkpoint.resume.Checkpointer`. The optimizer state is converted from
   parameter names to the positional ids of ``torch.optim.Optimizer.state_dict()``.

So the checkpoint has exactly the layout of a one-process run (``model/`` safetensors,
``optimizer.pt``, ``rng.pt``, ``state.json``): it resumes with any number of ranks, FSDP2 or
DDP or the local runner. On resume under FSDP2 every rank loads the full ``optimizer.pt`` and
``set_optimizer_state_dict`` keeps its own shard (:class:`ShardedOptimizerLoad`); the model is
loaded whole and sharded by ``fully_shard`` as on a fresh start.

Cost: rank 0 holds one extra CPU copy of the weights (the mirror) and, while saving, the
gathered optimizer state.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gyre.checkpoint.resume import Checkpointer
from gyre.checkpoint.snapshot import Snapshot


def make_mirror(model: torch.nn.Module, rank: int) -> torch.nn.Module | None:
    """Rank 0: a plain CPU copy of the unsharded ``model`` to write checkpoints from."""
    return copy.deepcopy(model).to("cpu") if rank == 0 else None


def _optimizer_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameter name of each optimizer slot, in ``state_dict()``'s positional order."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]


def _indexed(named: Mapping[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state dict -> the positional one ``Optimizer.state_dict()`` gives."""
    order = [n for g in named["param_groups"] for n in g["params"]]
    slot = {n: i for i, n in enumerate(order)}
    groups, start = [], 0
    for g in named["param_groups"]:
        ids = list(range(start, start + len(g["params"])))
        start += len(ids)
        groups.append({**g, "params": ids})
    state = {slot[n]: v for n, v in named["state"].items()}
    return {"state": state, "param_groups": groups}


def _named(indexed: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    if len(names) != sum(len(g["params"]) for g in indexed["param_groups"]):
        raise ValueError(
            f"optimizer.pt holds {sum(len(g['params']) for g in indexed['param_groups'])} "
            f"parameters; this model trains {len(names)}"
        )
    state = {names[int(i)]: v for i, v in indexed["state"].items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in indexed["param_groups"]]
    return {"state": state, "param_groups": groups}


class _Gathered:
    """The optimizer as :func:`gyre.checkpoint.snapshot.save` sees it: its gathered state."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


class ShardedOptimizerLoad:
    """Loads a whole (positional) optimizer state into an FSDP2 optimizer: every rank keeps its
    shard. Passed where :func:`gyre.checkpoint.snapshot.load_into` expects the optimizer."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def load_state_dict(self, indexed: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        named = _named(indexed, _optimizer_names(self.model, self.optimizer))
        opts = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(self.model, self.optimizer, named, options=opts)


def gather(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Collective: the whole model (and optimizer, name-keyed) on rank 0's CPU; empty on the
    other ranks. A snapshot: no tensor in it is the live state's, so later updates leave it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    live = _storages(model.state_dict())
    if optimizer is None:
        return _owned(get_model_state_dict(model, options=opts), live), {}
    live |= _storages(optimizer.state)
    full, optim = get_state_dict(model, optimizer, options=opts)
    return _owned(full, live), _owned(optim, live)


def _storages(tree: Any) -> set[int]:
    """The storage addresses of every tensor in ``tree`` (a DTensor's: its local shard's)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return _storages(tree.to_local())
    if isinstance(tree, torch.Tensor):
        return {tree.untyped_storage().data_ptr()} if tree.numel() else set()
    if isinstance(tree, Mapping):
        return set().union(*(_storages(v) for v in tree.values()))
    if isinstance(tree, list | tuple):
        return set().union(*(_storages(v) for v in tree))
    return set()


def _owned(tree: Any, live: set[int]) -> Any:
    """``tree`` with a copy of every tensor that shares storage with the live state.

    The gather copies what is sharded, but a tensor that is not a DTensor and already on the CPU
    comes back as the live tensor itself: AdamW's ``step`` counter above all, which the next
    ``optimizer.step()`` increments in place. Without the copy, a gathered state taken at step
    N reads N + 1 one update later."""
    if isinstance(tree, torch.Tensor):
        shared = tree.numel() and tree.untyped_storage().data_ptr() in live
        return tree.clone() if shared else tree
    if isinstance(tree, dict):
        return {k: _owned(v, live) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_owned(v, live) for v in tree]
    return tree


def gathered_model(trainer: Any) -> torch.nn.Module | None:
    """Collective: rank 0's mirror holding the current weights (None on the other ranks)."""
    full, _ = gather(trainer.model, None)
    mirror = trainer.comm.mirror
    if mirror is None:
        return None
    mirror.load_state_dict(full)
    return mirror


def save_gathered(
    trainer: Any,
    ckpt: Checkpointer,
    step: int,
    state: Mapping[str, Any],
    metrics_path: Path,
    generators: Mapping[str, Any] | None = None,
) -> str | None:
    """Collective: every rank calls it; rank 0 writes the whole-model checkpoint (returns its
    path), the other ranks return None."""
    full, optim = gather(trainer.model, trainer.optimizer)
    mirror = trainer.comm.mirror
    if mirror is None:
        return None
    mirror.load_state_dict(full)
    extra = trainer.value_model.save if trainer.value_model is not None else None
    optimizer = _Gathered(_indexed(optim))
    snap = Snapshot(step, dict(state), optimizer, trainer.scheduler, generators, extra=extra)
    return ckpt.save(mirror, trainer.tokenizer, snap, metrics_path)
