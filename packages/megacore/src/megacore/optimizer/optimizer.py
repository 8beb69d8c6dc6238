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

So memory per parameter is seed 002's table: fp16 params and grads 20 bytes
(4 + 16/d sharded), fp16 params with fp32 grads 18 (6 + 12/d), fp32 16 (8 + 8/d).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megacore import parallel_state as ps
from megacore.distributed import DistributedDataParallel
from megacore.optimizer.clip_grads import (
    clip_grad_norm,
    comm_device,
    counts_once,
    get_grad_norm,
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
        return None if grad is None else grad.view(-1)[self.start : self.end]


def _make_shard(param: nn.Parameter, start: int, end: int) -> Shard:
    if not param.is_contiguous():
        raise ValueError(f"optimizer: parameter of shape {tuple(param.shape)} is not contiguous")
    view = param.detach().view(-1)[start:end]
    master = view.clone().float() if param.dtype != torch.float32 else view
    # The marks gradient clipping reads to count every element of the model once.
    master.tensor_model_parallel = getattr(param, "tensor_model_parallel", False)
    master.shared_embedding = getattr(param, "shared_embedding", False)
    return Shard(param, start, end, master)


def _unique_params(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    params = (p for c in chunks for p in c.parameters() if p.requires_grad)
    return list(dict.fromkeys(params))


class MegatronOptimizer:
    """AdamW with master weights, loss scaling, clipping and (optionally) ZeRO-1 sharding.

    `model_chunks`: this rank's model chunks (one per virtual pipeline stage),
    wrapped in `DistributedDataParallel` when gradients are averaged over data
    parallel ranks (required for `use_distributed_optimizer`).
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
            self.shards = [_make_shard(p, 0, p.numel()) for p in _unique_params(self.model_chunks)]
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

        Call after `finalize_model_grads` (the data-parallel reduction).
        """
        grads = self._masters_take_grads()
        found_inf = self._unscale_and_check(grads)
        if self.grad_scaler:
            self.grad_scaler.update(found_inf)
        if found_inf:
            self.num_skipped_steps += 1
            for s in self.shards:
                s.master.grad = None
            return False, None, None
        masters = [s.master for s in self.shards]
        groups = self._norm_groups()
        if self.config.clip_grad > 0:
            grad_norm = clip_grad_norm(masters, self.config.clip_grad, groups=groups)
        else:
            grad_norm = get_grad_norm(masters, groups=groups)
        num_zeros = self._count_zeros(groups) if self.config.log_num_zeros_in_grad else None
        self.optimizer.step()
        for s in self.shards:
            if s.owns_master:
                s.param.detach().view(-1)[s.start : s.end].copy_(s.master)
        for chunk in self.ddp_chunks:
            chunk.all_gather_params()
        return True, grad_norm, num_zeros

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
        return groups

    def _unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide by the loss scale; True when any rank's gradients hold inf or nan."""
        if self.grad_scaler:
            inv = 1.0 / self.grad_scaler.scale
            for g in grads:
                g.mul_(inv)
        bad = any(not torch.isfinite(g).all() for g in grads)
        flag = torch.tensor([float(bad)], device=comm_device(grads))
        for group in self._norm_groups():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def _count_zeros(self, groups: list) -> int:
        masters = [s.master for s in self.shards if s.master.grad is not None]
        count = sum((m.grad == 0).sum().item() for m in masters if counts_once(m))
        total = torch.tensor([float(count)], device=comm_device(masters))
        for group in groups:
            dist.all_reduce(total, group=group)
        return int(total.item())

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

    # -- state by parameter, for checkpoints that change layout --------------------------

    def param_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """fp32 master, exp_avg and exp_avg_sq of every parameter of this rank, each of the
        parameter's shape (its TP shard), whole even when sharded over DP.

        Under the distributed optimizer each DP rank holds a flat range of each parameter;
        the ranges are summed over the data-parallel group (a collective: call on every rank).
        A layout-independent checkpoint saves these beside the weights.
        """
        out = {}
        group = self.ddp_chunks[0].group if self.sharded and self.ddp_chunks else None
        shards = {id(s.param): s for s in self.shards}
        for p in _unique_params(self.model_chunks):
            flat = torch.zeros(3, p.numel(), dtype=torch.float32, device=p.device)
            s = shards.get(id(p))
            if s is not None:
                state = self.optimizer.state.get(s.master, {})
                for row, value in enumerate(
                    (s.master, state.get("exp_avg"), state.get("exp_avg_sq"))
                ):
                    if value is not None:
                        flat[row, s.start : s.end] = value.detach().float().view(-1)
            if group is not None:
                dist.all_reduce(flat, group=group)
            out[p] = {
                name: flat[row].view(p.shape)
                for row, name in enumerate(("master", "exp_avg", "exp_avg_sq"))
            }
        return out

    def adam_step(self) -> int:
        """Adam's step count (the same for every parameter)."""
        for state in self.optimizer.state.values():
            if "step" in state:
                return int(state["step"])
        return 0

    def load_param_state(
        self, states: dict[nn.Parameter, dict[str, torch.Tensor]], adam_step: int
    ) -> None:
        """The inverse of `param_state()`: each rank keeps its own range of each parameter."""
        with torch.no_grad():
            for s in self.shards:
                if s.param not in states:
                    raise ValueError(
                        f"optimizer: no saved state for a parameter of shape {tuple(s.param.shape)}"
                    )
                state = {
                    k: v.reshape(-1)[s.start : s.end].to(s.master.device, torch.float32)
                    for k, v in states[s.param].items()
                }
                s.master.copy_(state["master"].view_as(s.master))
                if adam_step:
                    self.optimizer.state[s.master] = {
                        "step": torch.tensor(float(adam_step)),
                        "exp_avg": state["exp_avg"].clone().view_as(s.master),
                        "exp_avg_sq": state["exp_avg_sq"].clone().view_as(s.master),
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
