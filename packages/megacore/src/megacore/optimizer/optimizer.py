"""Adam over fp32 master weights, for fp32, bf16 and fp16 models, optionally sharded over DP.

One class covers Megatron-LM's FP32Optimizer, Float16OptimizerWithFloat16Params
and DistributedOptimizer, because they differ only in which elements a rank
keeps master copies of:

- each rank owns "shards": pieces of parameters, given as element ranges of
  the flattened parameter; without the distributed optimizer a shard is a whole
  parameter, with it the piece of the data-parallel gradient buffer this rank
  owns (`DistributedDataParallel.local_shard_ranges`);
- a shard's master is a view of the model parameter when that is fp32 (no
  copy), else an fp32 copy; its gradient is a view of `main_grad` (or
  `param.grad`) when that is fp32, else an fp32 copy made at each step;
- a step: gradients to masters, unscale and look for inf/nan (over the
  model-parallel group, and the data-parallel group when sharded), skip the
  step if found, clip by the global norm, AdamW on the masters, masters back
  to the model, and with sharding an all-gather of the updated parameters.

The speed path, each part switchable and tested equal to the plain one:
`fused_adam` runs torch's fused AdamW on CUDA and CPU (foreach elsewhere) instead of
its per-tensor loop; `fused_grad_norm` takes the inf/nan check and the norm
from one `torch._foreach_norm` pass, all-reduces them as one tensor per group
and reads that tensor once, the step's only host sync (the plain path syncs
per tensor and per reduction); `overlap_param_gather` on the
`DistributedDataParallel` chunks leaves the all-gather running after `step()`
until the next forward needs each bucket.

So memory per parameter is the optimizer's bytes-per-parameter table: fp16 params and grads 20 bytes
(4 + 16/d sharded), fp16 params with fp32 grads 18 (6 + 12/d), fp32 16 (8 + 8/d).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megacore import parallel_state as ps
from megacore.distributed import DistributedDataParallel
from megacore.distributed.data_parallel import is_expert_param
from megacore.optimizer.clip_grads import (
    clip_coefficient,
    clip_grad_norm,
    comm_device,
    counts_once,
    expert_norm_groups,
    get_grad_norm,
    norm_of,
    split_grad_stats,
)
from megacore.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megacore.precision import check_device_supports


@dataclass
class OptimizerConfig:
    """Megatron-LM's optimizer settings (names as its `OptimizerConfig`)."""

    lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 turns clipping off
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None  # a constant scale for fp16; None = dynamic
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    use_distributed_optimizer: bool = False
    log_num_zeros_in_grad: bool = False
    # The speed path (module docstring); False gives the plain per-tensor path.
    fused_adam: bool = True
    fused_grad_norm: bool = True
    # `step_on_device()`: a step that reads nothing from the device (torch's fused AdamW,
    # which skips on a device-side inf/nan flag, on any device).
    step_on_device: bool = False

    def __post_init__(self):
        if self.fp16 and self.bf16:
            raise ValueError("OptimizerConfig: fp16 and bf16 are exclusive; choose one")
        if self.clip_grad < 0:
            raise ValueError(f"OptimizerConfig: clip_grad must be >= 0, got {self.clip_grad}")


@dataclass
class Shard:
    """Elements [start, end) of the flattened `param` whose master copy this rank keeps."""

    param: nn.Parameter
    start: int
    end: int
    master: torch.Tensor

    @property
    def owns_master(self) -> bool:
        return self.param.dtype != torch.float32

    def model_grad(self) -> torch.Tensor | None:
        grad = getattr(self.param, "main_grad", None)
        grad = self.param.grad if grad is None else grad
        if grad is None:
            return None
        if isinstance(grad, DTensor):  # FSDP2: the local shard is this shard, whole
            return grad.to_local().view(-1)
        return grad.view(-1)[self.start : self.end]


def _marked(master: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """The marks gradient clipping reads to count every element of the model once."""
    master.tensor_model_parallel = getattr(param, "tensor_model_parallel", False)
    master.shared_embedding = getattr(param, "shared_embedding", False)
    master.allreduce = getattr(param, "allreduce", True)  # False: an expert parameter
    return master


def _make_shard(param: nn.Parameter, start: int, end: int) -> Shard:
    if not param.is_contiguous():
        raise ValueError(f"optimizer: parameter of shape {tuple(param.shape)} is not contiguous")
    view = param.detach().view(-1)[start:end]
    master = view.clone().float() if param.dtype != torch.float32 else view
    return Shard(param, start, end, _marked(master, param))


def _fully_sharded_shard(param: nn.Parameter) -> Shard:
    """FSDP2's fp32 DTensor parameter: its local rows are the master itself (no copy), at
    their flat range [start, end) of the (TP-local) parameter; FSDP shards dim 0 as
    torch.chunk does (ceil(rows / d) rows a rank, the last ranks fewer or none)."""
    from torch.distributed.tensor import Shard as Placement

    if param.placements != (Placement(0),) or param.dtype != torch.float32:
        raise ValueError(
            f"optimizer: a DTensor parameter of shape {tuple(param.shape)} is "
            f"{param.dtype} with placements {param.placements}; FSDP2's fp32 parameters "
            "sharded along dim 0 (fully_shard with a 1-D mesh) are what it takes"
        )
    local = param.detach().to_local()
    if not local.is_contiguous():
        raise ValueError(f"optimizer: parameter of shape {tuple(param.shape)} is not contiguous")
    rows = param.shape[0]
    per_rank = -(-rows // param.device_mesh.size())
    first = min(rows, param.device_mesh.get_local_rank() * per_rank)
    start = first * (param.numel() // rows) if rows else 0
    master = local.view(-1)
    return Shard(param, start, start + master.numel(), _marked(master, param))


def _unique_params(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    params = (p for c in chunks for p in c.parameters() if p.requires_grad)
    return list(dict.fromkeys(params))


# The devices with torch's fused AdamW kernel (one pass over each tensor for the whole update;
# the CPU's since torch 2.4, 4x faster there than foreach, which falls back to a per-tensor loop).
FUSED_ADAM_DEVICES = ("cuda", "cpu")


def _adam_implementation(fast: bool, masters: list[torch.Tensor]) -> dict:
    """torch AdamW's kernel choice: fused when every master is on a device with the fused
    kernel, foreach (a few kernels per group) elsewhere; `fast=False`: the per-tensor loop."""
    if not fast:
        return {"foreach": False}
    if masters and all(m.device.type in FUSED_ADAM_DEVICES for m in masters):
        return {"fused": True}
    return {"foreach": True}


class MegatronOptimizer:
    """AdamW with master weights, loss scaling, clipping and (optionally) ZeRO-1 sharding.

    `model_chunks`: this rank's model chunks (one per virtual pipeline stage),
    wrapped in `DistributedDataParallel` when gradients are averaged over data
    parallel ranks (required for `use_distributed_optimizer`), or fully sharded by
    torch's FSDP2 (ZeRO-3): then each fp32 parameter is a DTensor whose local shard is
    the master itself (updated in place; FSDP gathers it for the next forward), its
    gradient the local shard of the reduce-scattered gradient, and the norm sums over
    the FSDP mesh's group too, where each element lives on one rank (expert parameters
    sharded over the expert-data-parallel group: over that one, with the expert groups).
    """

    def __init__(self, config: OptimizerConfig, model_chunks: Sequence[nn.Module]):
        self.config = config
        self.model_chunks = list(model_chunks)
        self.ddp_chunks = [c for c in self.model_chunks if isinstance(c, DistributedDataParallel)]
        self.sharded = config.use_distributed_optimizer
        if self.sharded:
            for i, chunk in enumerate(self.model_chunks):
                _check_wrapped_for_sharding(chunk, i)
            self.shards = [
                _make_shard(r.param, *r.param_range)
                for chunk in self.model_chunks
                for r in chunk.local_shard_ranges()
            ]
        else:
            self.shards = [
                _fully_sharded_shard(p) if isinstance(p, DTensor) else _make_shard(p, 0, p.numel())
                for p in _unique_params(self.model_chunks)
            ]
        # FSDP2's data-parallel groups (DTensor parameters: each rank holds a piece).
        self.fully_sharded_groups = _fully_sharded_groups(self.model_chunks, self.shards)
        # Whether each expert element lives on one rank of expert DP too (the distributed
        # optimizer's expert buffers, or FSDP2's expert units over that group, megatrain's
        # apply_fsdp): their norm terms are then summed over it as well (`expert_norm_groups`).
        self.experts_sharded = self.sharded or any(
            isinstance(s.param, DTensor) and is_expert_param(s.param) for s in self.shards
        )
        self._check_dtypes()
        low = torch.float16 if config.fp16 else torch.bfloat16 if config.bf16 else None
        if low is not None and self.shards:
            check_device_supports(low, self.shards[0].param.device)
        # Decoupled weight decay on matrices only; biases and norm weights (1-D) do not decay.
        decay = [s.master for s in self.shards if s.param.dim() > 1]
        no_decay = [s.master for s in self.shards if s.param.dim() <= 1]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": config.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            **(
                {"fused": True}
                if config.step_on_device
                else _adam_implementation(config.fused_adam, decay + no_decay)
            ),
        )
        self.grad_scaler = None
        if config.fp16:
            if config.loss_scale is None:
                self.grad_scaler = DynamicGradScaler(
                    initial_scale=config.initial_loss_scale,
                    min_scale=config.min_loss_scale,
                    growth_interval=config.loss_scale_window,
                    hysteresis=config.hysteresis,
                )
            else:
                self.grad_scaler = ConstantGradScaler(config.loss_scale)
        self.num_skipped_steps = 0

    def _check_dtypes(self) -> None:
        want = torch.float16 if self.config.fp16 else torch.bfloat16 if self.config.bf16 else None
        for s in self.shards:
            if s.param.dtype == torch.float32 or s.param.dtype == want:
                continue
            name = "fp16=True" if s.param.dtype == torch.float16 else "bf16=True"
            raise ValueError(
                f"optimizer: a parameter of shape {tuple(s.param.shape)} is {s.param.dtype} but "
                f"OptimizerConfig has fp16={self.config.fp16}, bf16={self.config.bf16}; set "
                f"{name} (and convert the model before wrapping it)"
            )

    # -- what the training loop calls ------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (a learning-rate scheduler sets 'lr' here)."""
        return self.optimizer.param_groups

    def get_loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The schedules' `grad_scale_func`: the loss to call backward on."""
        return loss * self.get_loss_scale() if self.grad_scaler else loss

    def zero_grad(self) -> None:
        """Zero model gradients (and DDP buffers) and drop the fp32 gradient copies."""
        for chunk in self.model_chunks:
            if isinstance(chunk, DistributedDataParallel):
                chunk.zero_grad_buffer()
            else:
                chunk.zero_grad(set_to_none=True)
        for s in self.shards:
            s.master.grad = None

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        """(update_successful, grad_norm, num_zeros_in_grad); (False, None, None) if skipped.

        Call after `finalize_model_grads` (the data-parallel reduction).  With
        `fused_grad_norm` the step reads the device once (twice with log_num_zeros_in_grad).
        """
        # An overlapped all-gather of the last step still reads the shards Adam rewrites.
        self.finish_param_sync()
        grads = self._masters_take_grads()
        groups = self._norm_groups()
        expert_groups = expert_norm_groups(self.experts_sharded)
        if self.config.fused_grad_norm:
            found_inf, grad_norm = self._unscale_check_and_norm(grads)
        else:
            found_inf, grad_norm = self._unscale_and_check(grads), None
        if self.grad_scaler:
            self.grad_scaler.update(found_inf)
        if found_inf:
            self.num_skipped_steps += 1
            for s in self.shards:
                s.master.grad = None
            return False, None, None
        if grad_norm is None:  # the plain path reduces and reads the norm on its own
            masters = [s.master for s in self.shards]
            if self.config.clip_grad > 0:
                grad_norm = clip_grad_norm(
                    masters,
                    self.config.clip_grad,
                    groups=groups,
                    foreach=False,
                    expert_groups=expert_groups,
                )
            else:
                grad_norm = get_grad_norm(
                    masters, groups=groups, foreach=False, expert_groups=expert_groups
                )
        elif self.config.clip_grad > 0:
            coeff = clip_coefficient(grad_norm, self.config.clip_grad)
            if coeff < 1.0:
                self._clip(grads, torch.tensor(coeff, dtype=torch.float32))
        num_zeros = self._count_zeros(groups) if self.config.log_num_zeros_in_grad else None
        self._adam_into_model()
        return True, grad_norm, num_zeros

    def _clip(self, grads: list[torch.Tensor], coeff: torch.Tensor) -> None:
        """The gradients times the clip coefficient (a 0-d tensor): with fused AdamW, its
        `grad_scale` (1 / coeff), which the kernel divides each gradient by as it reads it,
        so clipping costs no pass over the gradients of its own (the scaled gradients are
        written back, as the multiply would leave them); else one foreach multiply."""
        if not grads:  # a rank without gradients to clip
            return
        coeff = coeff.to(grads[0].device)
        if self.optimizer.defaults.get("fused"):
            self.optimizer.grad_scale = coeff.reciprocal()
        else:
            torch._foreach_mul_(grads, coeff)

    def _adam_into_model(self) -> None:
        """AdamW on the masters, the masters copied into the model (when they are copies), and
        with sharding the all-gather (left running under overlap_param_gather)."""
        self.optimizer.step()
        self.optimizer.grad_scale = None  # this step's clip only
        owned = [s for s in self.shards if s.owns_master]
        if owned:
            torch._foreach_copy_(
                [s.param.detach().view(-1)[s.start : s.end] for s in owned],
                [s.master for s in owned],
            )
        for chunk in self.ddp_chunks:
            chunk.all_gather_params()

    def _grad_stats(self) -> torch.Tensor:
        """`grad_stats` of the masters' gradients: those that enter the norm on this rank,
        and the rest, expert ones reduced over their own groups (`expert_norm_groups`)."""
        counted, others = [], []
        for s in self.shards:
            if s.master.grad is not None:
                (counted if counts_once(s.master) else others).append(s.master)
        return split_grad_stats(
            [m.grad for m in counted],
            [m.grad for m in others],
            [is_expert_param(m) for m in counted + others],
            groups=self._norm_groups(),
            expert_groups=expert_norm_groups(self.experts_sharded),
        )

    @torch.no_grad()
    def step_on_device(self) -> torch.Tensor:
        """`step()` without reading the device: [grad norm, 1.0 if any rank's gradients hold
        inf or nan else 0.0] as a device tensor, for the caller to read with whatever else it
        reads (its iteration's one host sync) and hand to `settle_step`.

        The same step as `step()` with `fused_grad_norm`: the clip coefficient is applied on the
        device (multiplying by exactly 1 when under the limit), and fused AdamW skips the update
        on the device-side flag (moments and step counts untouched), so a step with inf or nan
        leaves the masters, and so the model, as they were.  Needs `step_on_device=True`.
        """
        if not self.config.step_on_device:
            raise ValueError(
                "MegatronOptimizer.step_on_device needs OptimizerConfig(step_on_device=True)"
            )
        self.finish_param_sync()
        grads = self._masters_take_grads()
        if self.grad_scaler and grads:
            torch._foreach_mul_(grads, 1.0 / self.grad_scaler.scale)
        stats = self._grad_stats()
        norm, found_inf = stats[0].sqrt(), (stats[1] > 0).float()
        if self.config.clip_grad > 0 and grads:
            self._clip(grads, (self.config.clip_grad / (norm + 1e-6)).clamp(max=1.0))
        self.optimizer.found_inf = (
            found_inf.to(self.shards[0].master.device) if self.shards else None
        )
        self._adam_into_model()
        return torch.stack([norm, found_inf])

    def settle_step(self, grad_norm: float, found_inf: float) -> tuple[bool, float | None, None]:
        """What `step()` returns, from the values `step_on_device` left on the device; updates
        the loss scale and the count of skipped steps."""
        if self.grad_scaler:
            self.grad_scaler.update(bool(found_inf))
        if found_inf:
            self.num_skipped_steps += 1
            return False, None, None
        return True, grad_norm, None

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gathers `step()` left running (overlap_param_gather).

        The next forward waits for each bucket as it reaches it; call this before reading
        the parameters any other way (a checkpoint), or it may see other ranks' old values.
        """
        for chunk in self.ddp_chunks:
            chunk.finish_param_sync()

    def _masters_take_grads(self) -> list[torch.Tensor]:
        grads = []
        for s in self.shards:
            g = s.model_grad()
            if g is not None and g.dtype != torch.float32:
                g = g.float()
            s.master.grad = g
            if g is not None:
                grads.append(g)
        return grads

    def _norm_groups(self) -> list:
        groups = [ps.get_model_parallel_group()]
        if self.sharded:
            groups += list(dict.fromkeys(c.group for c in self.ddp_chunks))
        return groups + self.fully_sharded_groups

    def _unscale_check_and_norm(self, grads: list[torch.Tensor]) -> tuple[bool, float]:
        """(whether any rank's gradients hold inf or nan, the global gradient norm), from one
        foreach norm pass, one all-reduce per group and one host sync."""
        if self.grad_scaler and grads:
            # One foreach pass; torch._amp_foreach_non_finite_check_and_unscale_ would also
            # flag inf/nan, but the norms below do that anyway.
            torch._foreach_mul_(grads, 1.0 / self.grad_scaler.scale)
        value, bad = self._grad_stats().tolist()  # the one sync
        return bad > 0, norm_of(value, 2.0)

    def _unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """The plain path: divide by the loss scale; True when any rank's gradients hold
        inf or nan (a host sync per gradient)."""
        if self.grad_scaler:
            inv = 1.0 / self.grad_scaler.scale
            for g in grads:
                g.mul_(inv)
        bad = any(not torch.isfinite(g).all() for g in grads)
        flag = torch.tensor([float(bad)], device=comm_device(grads))
        # Expert gradients differ between expert-parallel ranks: their groups hear it too.
        for group in self._norm_groups() + (expert_norm_groups(self.experts_sharded) or []):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def _count_zeros(self, groups: list) -> int:
        masters = [s.master for s in self.shards if s.master.grad is not None]
        device = comm_device(masters)
        # Summed on the device, so the count costs one host sync, not one per tensor.
        expert_groups = expert_norm_groups(self.experts_sharded)
        totals = []
        for expert, over in ((False, groups), (True, expert_groups)):
            if expert and over is None:  # the expert layout is the dense one: counted above
                break
            total = torch.zeros(1, dtype=torch.int64, device=device)
            for m in masters:
                if counts_once(m) and (expert_groups is None or expert == is_expert_param(m)):
                    total += (m.grad == 0).sum().to(device)
            for group in over:
                dist.all_reduce(total, group=group)
            totals.append(int(total.item()))
        return sum(totals)

    # -- state ------------------------------------------------------------------------------

    def _layout(self) -> list[tuple[tuple[int, ...], int, int]]:
        return [(tuple(s.param.shape), s.start, s.end) for s in self.shards]

    def state_dict(self) -> dict:
        """This rank's state: Adam moments, fp32 masters, loss scaler, and the shard layout."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": [s.master.clone() if s.owns_master else None for s in self.shards],
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
            "num_skipped_steps": self.num_skipped_steps,
            "layout": self._layout(),
        }

    # -- state by shard, for checkpoints that change layout ----------------------------------

    def shard_state(self) -> list[tuple[Shard, dict[str, torch.Tensor]]]:
        """This rank's fp32 master, exp_avg and exp_avg_sq, shard by shard: flat tensors of
        the shard's elements [start, end) of its flattened parameter (a TP shard's).

        The tensors the optimizer holds, not copies, and no collective: a layout-independent
        checkpoint writes each rank's own ranges (`megatrain.checkpoint.save`), so saving holds
        no more optimizer state than training does.  Before the first step the moments do
        not exist yet and are zeros of the shard's size.
        """
        out = []
        for s in self.shards:
            state = self.optimizer.state.get(s.master, {})
            values = {"master": s.master.detach()}
            for key in ("exp_avg", "exp_avg_sq"):
                value = state.get(key)
                values[key] = torch.zeros_like(values["master"]) if value is None else value
            out.append((s, {k: v.detach().view(-1) for k, v in values.items()}))
        return out

    def adam_step(self) -> int:
        """Adam's step count (the same for every parameter)."""
        for state in self.optimizer.state.values():
            if "step" in state:
                return int(state["step"])
        return 0

    def load_shard_state(
        self, read: Callable[[list[tuple[Shard, dict[str, torch.Tensor]]]], None], adam_step: int
    ) -> None:
        """The inverse of `shard_state()`: `read(targets)` fills, for each shard, the flat fp32
        tensors of its elements [start, end) under "master" (the master itself) and, when
        `adam_step` > 0, "exp_avg" and "exp_avg_sq" (new tensors, installed afterwards).

        Reading straight into the shard's own tensors keeps loading at this rank's own
        state; with `adam_step` 0 the moments are dropped (Adam starts afresh).
        """
        targets = []
        for s in self.shards:
            values = {"master": s.master.detach().view(-1)}
            if adam_step:
                values["exp_avg"] = torch.empty_like(values["master"])
                values["exp_avg_sq"] = torch.empty_like(values["master"])
            targets.append((s, values))
        with torch.no_grad():
            read(targets)
        # Where torch's AdamW keeps the step count: on the device for fused or capturable
        # groups (their kernels read it there), else a CPU scalar.
        on_device = {
            id(p)
            for g in self.optimizer.param_groups
            if g.get("fused") or g.get("capturable")
            for p in g["params"]
        }
        for s, values in targets:
            if adam_step:
                device = s.master.device if id(s.master) in on_device else "cpu"
                self.optimizer.state[s.master] = {
                    "step": torch.tensor(float(adam_step), dtype=torch.float32, device=device),
                    "exp_avg": values["exp_avg"].view_as(s.master),
                    "exp_avg_sq": values["exp_avg_sq"].view_as(s.master),
                }
            else:
                self.optimizer.state.pop(s.master, None)

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; refuses state saved for other parameters or another sharding."""
        saved, here = state["layout"], self._layout()
        if len(saved) != len(here):
            raise ValueError(
                f"optimizer state holds {len(saved)} parameter shards, this rank has "
                f"{len(here)}: it was saved for another model or data-parallel layout"
            )
        for i, (a, b) in enumerate(zip(saved, here, strict=True)):
            if tuple(a[0]) != b[0] or tuple(a[1:]) != b[1:]:
                raise ValueError(
                    f"optimizer state, shard {i}: saved for a parameter of shape {tuple(a[0])}, "
                    f"elements [{a[1]}, {a[2]}); here shape {b[0]}, elements [{b[1]}, {b[2]}): "
                    "another model or data-parallel layout"
                )
        if (state["grad_scaler"] is None) != (self.grad_scaler is None):
            raise ValueError("optimizer state: saved with and loaded without fp16 (or the reverse)")
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for s, master in zip(self.shards, state["masters"], strict=True):
                if s.owns_master:
                    s.master.copy_(master)
        if self.grad_scaler:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        self.num_skipped_steps = int(state["num_skipped_steps"])


def _fully_sharded_groups(chunks: Sequence[nn.Module], shards: list[Shard]) -> list:
    """The process groups FSDP2 shards `chunks` over: each chunk's `fully_sharded_group` (set
    by whoever sharded it, megatrain's `apply_fsdp`), else its DTensor parameters' mesh's.

    The group object is taken as given: `DeviceMesh.get_group()` looks a group up by name
    and may hand back another Python object for the same group (seen after process groups
    were made again in one process), which would count the group twice in the norm."""
    groups = []
    for chunk in chunks:
        params = [s.param for s in shards if isinstance(s.param, DTensor)]
        group = getattr(chunk, "fully_sharded_group", None)
        if group is None and params:
            group = params[0].device_mesh.get_group()
        if group is not None and all(g is not group for g in groups):
            groups.append(group)
    return groups


def _check_wrapped_for_sharding(chunk: nn.Module, index: int) -> None:
    if isinstance(chunk, DistributedDataParallel) and chunk.use_distributed_optimizer:
        return
    what = type(chunk).__name__
    if isinstance(chunk, DistributedDataParallel):
        what += " built with use_distributed_optimizer=False"
    raise ValueError(
        "use_distributed_optimizer=True needs every model chunk wrapped in "
        "megacore.distributed.DistributedDataParallel(..., use_distributed_optimizer=True); "
        f"model chunk {index} is a {what}"
    )


def get_megatron_optimizer(
    config: OptimizerConfig, model_chunks: Sequence[nn.Module]
) -> MegatronOptimizer:
    """The optimizer for this rank's model chunks, as Megatron-LM's function of the same name."""
    return MegatronOptimizer(config, model_chunks)
