"""Data-parallel training over ``torch.distributed`` (no Ray here: runners set up the group).

Why not wrap the model in ``DistributedDataParallel``: DDP all-reduces on every ``backward``, so
every rank must run the same number of micro-batches, and it averages gradients, which is only
right when every rank's loss is normalised by its *own* count. gyre's loss is normalised by the
step's *global* token (or row) count, fixed before the micro-batch loop
(``policy_update(reduce_counts=...)`` with :meth:`TorchCollective.reduce_counts`), so the
per-rank gradients must be **summed**, once per optimizer step. That is what
:meth:`TorchCollective.sync_gradients` does (``policy_update(sync_grads=...)``): the same
all-reduce DDP performs, done once after the micro-batch loop (bucketed into one flat tensor), and
it keeps ranks with unequal micro-batch counts from deadlocking. Parameters start equal on every
rank (:meth:`TorchCollective.broadcast_parameters`, as DDP does at construction).

``strategy: fsdp2`` shards parameters with ``torch.distributed.fsdp.fully_shard``; FSDP2
reduce-scatters gradients *averaged* over ranks inside backward, so :class:`FSDPCollective`
rescales the loss weights by the world size instead of summing afterwards. Every rank must then
run the same number of forward and backward passes (each one is a collective), though a rank's
share of whole groups can hold more rows than another's: :mod:`gyre.trainer.lockstep` pads the
ranks to the same counts with zero-weight micro-batches. The
path is the GPU default (nccl) and also runs on CPU over gloo (torch 2.13):
``tests/unit/test_fsdp2_cpu.py`` checks two CPU ranks against one process. It has not run on a
GPU in this repository's tests (no GPU was lent), see docs/cluster.md.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from gyre.algos.aggregate import StepCounts
from gyre.trainer.lockstep import Lockstep


class TorchCollective:
    """Gradient sum + global counts over the default process group (gloo on CPU, nccl on GPU)."""

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group")
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.device = torch.device("cpu")  # where the collectives' tensors live

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        out = value.detach().clone().float()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def reduce_counts(self, counts: StepCounts) -> StepCounts:
        """This rank's step counts -> the whole step's (tokens and rows summed, the longest row
        of ``seq-mean-token-sum-norm`` maxed): ``policy_update(reduce_counts=...)``."""
        sums = self.all_reduce_sum(torch.tensor([counts.tokens, counts.rows]))
        longest = torch.tensor([counts.norm_len], dtype=torch.float32)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        return StepCounts(float(sums[0]), float(sums[1]), float(longest[0]))

    def most(self, n: int) -> int:
        """The largest ``n`` over ranks (every rank calls it with its own)."""
        out = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return int(out.item())

    def lockstep(self) -> Lockstep:
        """``policy_update(lockstep=...)``: the same optimizer steps on every rank (the counts
        and the gradient sum are collectives once per step)."""
        return Lockstep(self.most, forwards=False)

    def sync_gradients(self, model: torch.nn.Module) -> None:
        _all_reduce_grads(model, 1.0)

    def sync_module_gradients(self, module: torch.nn.Module) -> None:
        """Sum an unsharded module's gradients (a value model) over ranks, as for the policy."""
        _all_reduce_grads(module, 1.0)

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0)

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights on CPU (every rank holds them whole under DDP)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


class FSDPCollective(TorchCollective):
    """FSDP2: backward reduce-scatters averaged gradients, so the loss weights scale by W.

    Collectives run on the process group's device: the current GPU under nccl, the CPU under
    gloo (tested on CPU; not yet run on a GPU here).
    """

    def __init__(self) -> None:
        super().__init__()
        nccl = dist.get_backend() == "nccl"
        if nccl:
            self.device = torch.device("cuda", torch.cuda.current_device())
        # rank 0: a plain CPU copy of the model that whole-model checkpoints are written from
        # (gyre.trainer.fsdp_checkpoint); None on the other ranks
        self.mirror: torch.nn.Module | None = None

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        out = value.detach().clone().float().to(self.device)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        # Dividing the loss weights by (global count / W) makes the averaged gradient the sum.
        return (out / self.world_size).cpu()

    def reduce_counts(self, counts: StepCounts) -> StepCounts:
        sums = self.all_reduce_sum(torch.tensor([counts.tokens, counts.rows]))
        longest = torch.tensor([counts.norm_len], dtype=torch.float32, device=self.device)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        return StepCounts(float(sums[0]), float(sums[1]), float(longest[0]))

    def lockstep(self) -> Lockstep:
        """Every forward and backward is a collective too: micro-batches are padded as well."""
        return Lockstep(self.most, forwards=True)

    def sync_gradients(self, model: torch.nn.Module) -> None:
        return  # done inside backward by FSDP2's reduce-scatter

    def sync_module_gradients(self, module: torch.nn.Module) -> None:
        """An unsharded module (a value model) is not reduced by FSDP2: its gradients are summed
        here and divided by W, because the loss weights were scaled by W (see the class)."""
        _all_reduce_grads(module, 1.0 / self.world_size)

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        return  # fully_shard keeps rank 0's initialisation via the sharded load below

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=opts)


def _all_reduce_grads(module: torch.nn.Module, scale: float) -> None:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads or dist.get_world_size() == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    if scale != 1.0:
        flat = flat * scale
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def shard_fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    """Apply FSDP2 per decoder layer, then to the root (the usual Llama recipe)."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", model), "layers", [])
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
