"""Data parallelism with gradients accumulated into contiguous buffers (Megatron-LM's DDP).

Each parameter's gradient lives in `param.main_grad`, a view into one flat
buffer per (parameter dtype, gradient dtype); gradients are fp32 for bf16/fp16
models with `grad_reduce_in_fp32=True`.  Parameters are laid out in reverse
order of registration, which is close to the order backward produces their
gradients, and each buffer is cut into buckets of about `bucket_size` elements.
A hook after each gradient accumulation adds `param.grad` into `main_grad` and
frees `param.grad`.  On the last microbatch (outside `no_sync()`) a bucket is
reduced over the data-parallel group as soon as all its gradients are in
(`overlap_grad_reduce=True`), or all buckets at `finish_grad_sync()`.
Gradients are averaged: each rank scales by 1/dp before the sum.

Every parameter starts at a multiple of `PARAM_ALIGNMENT` elements of its buffer, so each
parameter and gradient view starts on a 16-byte boundary whatever the sizes before it
(CUDA's grouped GEMM refuses a weight that does not: "expected data_ptr to be aligned to
16 bytes"); the padding between them is zeros that no parameter owns.

With `use_distributed_optimizer=True` (ZeRO-1) every bucket is padded to a multiple of
lcm(its group's size, `BUCKET_ALIGNMENT`) elements (megatron-core's rule) and split into
equal contiguous shards, each a multiple of 128 / gcd(size, 128) elements; the reduction
is a reduce-scatter, after which rank r holds the summed gradients of its shard
only.  The parameters then live in a param buffer laid out like the gradients,
so the optimizer updates its shard in place and `all_gather_params()` gives
every rank the whole model again.  A parameter marked `shared_embedding` (the
tied word embeddings on the first and last pipeline stage) gets a bucket of its
own, so both copies shard identically and summing them over the stages after
the reduce-scatter stays exact.

With `overlap_param_gather=True` (Megatron-LM's flag of that name, distributed
optimizer only) `all_gather_params()` starts the bucket all-gathers and returns;
a forward pre-hook on each module that holds parameters waits for the gathers of
its parameters' buckets, so the communication overlaps the next forward.  What
reads the parameters another way first (a checkpoint) calls `finish_param_sync()`.

The gradient hook is Megatron-LM's param hook: the add into `main_grad` is the
only pass accumulation takes (no per-step copy into the buffer).  With
`gradient_accumulation_fusion=True` (Megatron-LM's flag) even that goes: each
parameter gets `main_grad_written`, and the column- and row-parallel linears'
backward (`tensor_parallel.linear(..., accumulate=True)`) adds their weight
gradient into `main_grad` in the GEMM itself and calls it instead of producing
`param.grad`; every other parameter (biases, norms, embeddings) keeps the hook.

Expert parameters of a mixture of experts (marked `allreduce = False`, megatron-core's
mark) live in buffers of their own, reduced (or sharded, with the distributed optimizer)
over the expert-data-parallel group instead: the ranks holding the same expert shard.  They
are divided by the dense data-parallel size all the same: the loss is the mean over the
dense replicas' batches, and an expert's gradient on one rank already sums what every token
routed to it (from any rank of its expert-parallel group) contributed.  Part of
megacore.moe's gradient-scale rule: the EDP ranks of one expert slice take the tokens of
disjoint ETP x EP groups, so their sum covers the stage's tokens once, as the dense one does.
"""

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megacore import parallel_state as ps
from megacore.collectives import all_gather_flat, reduce_scatter_flat

# A parameter's start in its buffer, in elements: 64 elements are at least 64 bytes in any
# dtype (fp8 up), so a view starting there is 16-byte aligned in the buffer's allocation
# (aligned itself); megatron-core pads parameter starts to 64 elements too.
PARAM_ALIGNMENT = 64
# With sharding a bucket's length is a multiple of lcm(shards, 128), as in megatron-core:
# divisible by the group for equal shards, and a group size that is not a power of two
# (an expert data-parallel size of 3) leaves the next bucket's start aligned all the same.
BUCKET_ALIGNMENT = 128


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(eq=False)
class Bucket:
    grad_data: (
        torch.Tensor
    )  # a view into the buffer's grad_data, length a multiple of dp if sharded
    param_data: torch.Tensor | None  # the same range of the param buffer (sharded only)
    offset: int  # where the bucket starts in its buffer
    params: list[nn.Parameter]
    group: dist.ProcessGroup | None = None  # what it is reduced over (DP, or expert DP)
    shards: int = 1  # that group's size (how many shards when sharded)
    shard_rank: int = 0  # this rank in it
    ready: set = field(default_factory=set)
    handle: object = None  # the gradient reduction in flight
    gather: object = None  # the parameter all-gather in flight (overlap_param_gather)


@dataclass(eq=False)
class GradBuffer:
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    grad_data: torch.Tensor
    param_data: torch.Tensor | None
    buckets: list[Bucket]
    param_ranges: dict[nn.Parameter, tuple[int, int]]  # [start, end) of each parameter

    @property
    def padding(self) -> int:
        """Elements no parameter holds: the alignment of parameter starts and bucket ends."""
        return self.grad_data.numel() - sum(
            end - start for start, end in self.param_ranges.values()
        )


@dataclass(frozen=True, eq=False)
class ShardRange:
    """Where a piece of a parameter sits in this data-parallel rank's shard (its ranges).

    `world`: [start, end) in the buffer; `local`: in this rank's shard of the bucket;
    `param`: in the flattened parameter.
    """

    param: nn.Parameter
    buffer: GradBuffer
    bucket: Bucket
    world: tuple[int, int]
    local: tuple[int, int]
    param_range: tuple[int, int]


def is_expert_param(p: nn.Parameter) -> bool:
    """Whether `p` is an expert parameter (megatron-core's mark: not all-reduced over DP)."""
    return not getattr(p, "allreduce", True)


def _bucket_layout(params: list[nn.Parameter], bucket_size: int) -> list[list[nn.Parameter]]:
    buckets, current, size = [], [], 0
    for p in params:
        if getattr(p, "shared_embedding", False):
            buckets += [current, [p]] if current else [[p]]
            current, size = [], 0
            continue
        current.append(p)
        size += p.numel()
        if size >= bucket_size:
            buckets.append(current)
            current, size = [], 0
    return [*buckets, current] if current else buckets


class DistributedDataParallel(nn.Module):
    def __init__(
        self,
        module: nn.Module,
        *,
        grad_reduce_in_fp32: bool = False,
        overlap_grad_reduce: bool = False,
        use_distributed_optimizer: bool = False,
        bucket_size: int = 40_000_000,
        data_parallel_group: dist.ProcessGroup | None = None,
        overlap_param_gather: bool = False,
        gradient_accumulation_fusion: bool = False,
        expert_data_parallel_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        if bucket_size < 1:
            raise ValueError(
                f"DistributedDataParallel: bucket_size must be >= 1, got {bucket_size}"
            )
        if overlap_param_gather and not use_distributed_optimizer:
            raise ValueError(
                "DistributedDataParallel: overlap_param_gather needs "
                "use_distributed_optimizer=True (without it no parameters are gathered)"
            )
        self.module = module
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_param_gather = overlap_param_gather
        self.group = data_parallel_group or ps.get_data_parallel_group()
        self.dp_size = dist.get_world_size(self.group)
        self.dp_rank = dist.get_rank(self.group)
        self.sync_enabled = True
        params = [p for p in module.parameters() if p.requires_grad]
        params = list(dict.fromkeys(params))[::-1]  # unique, roughly in backward order
        self.expert_group = None
        if any(is_expert_param(p) for p in params):
            self.expert_group = expert_data_parallel_group or ps.get_expert_data_parallel_group()
        by_dtype: dict[tuple[torch.dtype, torch.dtype, bool], list[nn.Parameter]] = {}
        for p in params:
            grad_dtype = torch.float32 if grad_reduce_in_fp32 else p.dtype
            by_dtype.setdefault((p.dtype, grad_dtype, is_expert_param(p)), []).append(p)
        self.buffers = [
            self._make_buffer(dtypes, group_params, bucket_size)
            for dtypes, group_params in by_dtype.items()
        ]
        self.buckets = [b for buffer in self.buffers for b in buffer.buckets]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        for p in params:
            p.main_grad_written = self._main_grad_written if gradient_accumulation_fusion else None
        if overlap_param_gather:
            self._hooks += [
                m.register_forward_pre_hook(self._params_needed)
                for m in module.modules()
                if any(id(p) in self._bucket_of for p in m.parameters(recurse=False))
            ]

    def _make_buffer(self, dtypes, params, bucket_size) -> GradBuffer:
        param_dtype, grad_dtype, expert = dtypes
        group = self.expert_group if expert else self.group
        shards, shard_rank = dist.get_world_size(group), dist.get_rank(group)
        layout, ranges, offset = [], {}, 0
        for members in _bucket_layout(params, bucket_size):
            start = offset = _round_up(offset, PARAM_ALIGNMENT)
            for p in members:
                offset = _round_up(offset, PARAM_ALIGNMENT)
                ranges[p] = (offset, offset + p.numel())
                offset += p.numel()
            if self.use_distributed_optimizer:
                offset = start + _round_up(offset - start, math.lcm(shards, BUCKET_ALIGNMENT))
            layout.append((members, start, offset))
        device = params[0].device
        grad_data = torch.zeros(offset, dtype=grad_dtype, device=device)
        param_data = None
        if self.use_distributed_optimizer:
            param_data = torch.zeros(offset, dtype=param_dtype, device=device)
            for p, (start, end) in ranges.items():
                param_data[start:end].copy_(p.data.reshape(-1))
                p.data = param_data[start:end].view_as(p)
        for p, (start, end) in ranges.items():
            p.main_grad = grad_data[start:end].view_as(p)
        buckets = [
            Bucket(
                grad_data[start:end],
                None if param_data is None else param_data[start:end],
                start,
                members,
                group,
                shards,
                shard_rank,
            )
            for members, start, end in layout
        ]
        return GradBuffer(param_dtype, grad_dtype, grad_data, param_data, buckets, ranges)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating (all microbatches but the last)."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def _grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is None:  # an autograd node that handed no gradient (a graphed layer's
            return  # fused weights: their gradient is in main_grad, announced by the layer)
        param.main_grad.add_(param.grad)
        param.grad = None
        self._main_grad_written(param)

    def _main_grad_written(self, param: nn.Parameter) -> None:
        """`param`'s gradient of this backward is in main_grad: reduce its bucket once full."""
        if not (self.sync_enabled and self.overlap_grad_reduce):
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params) and bucket.handle is None:
            self._start(bucket)

    @staticmethod
    def _shard(bucket: Bucket, data: torch.Tensor) -> torch.Tensor:
        size = data.numel() // bucket.shards
        return data[bucket.shard_rank * size : (bucket.shard_rank + 1) * size]

    def _start(self, bucket: Bucket) -> None:
        # Part of megacore.moe's gradient-scale rule: divided by the dense size (megatrain's
        # DP x CP), for expert buckets too, though they are summed over expert DP.
        if self.dp_size > 1:
            bucket.grad_data.div_(self.dp_size)
        if bucket.shards == 1:
            bucket.handle = True
            return
        if self.use_distributed_optimizer:
            bucket.handle = reduce_scatter_flat(
                self._shard(bucket, bucket.grad_data),
                bucket.grad_data,
                group=bucket.group,
                async_op=True,
            )
        else:
            bucket.handle = dist.all_reduce(bucket.grad_data, group=bucket.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Complete the data-parallel reduction of every bucket (call after the last backward)."""
        for bucket in self.buckets:
            if bucket.handle is None:
                self._start(bucket)
        for bucket in self.buckets:
            if bucket.handle is not True:
                bucket.handle.wait()
            bucket.handle = None
            bucket.ready.clear()

    def local_shard_ranges(self) -> list[ShardRange]:
        """The pieces of parameters this rank owns (all of every parameter without sharding)."""
        out = []
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                if self.use_distributed_optimizer:
                    size = bucket.grad_data.numel() // bucket.shards
                    lo = bucket.offset + bucket.shard_rank * size
                    hi = lo + size
                else:
                    lo, hi = bucket.offset, bucket.offset + bucket.grad_data.numel()
                for p in bucket.params:
                    start, end = buffer.param_ranges[p]
                    a, b = max(start, lo), min(end, hi)
                    if a < b:
                        out.append(
                            ShardRange(
                                p, buffer, bucket, (a, b), (a - lo, b - lo), (a - start, b - start)
                            )
                        )
        return out

    def all_gather_params(self) -> None:
        """Give every rank the parameters the others updated (distributed optimizer only).

        Under overlap_param_gather this only starts the all-gathers.
        """
        if not self.use_distributed_optimizer:
            return
        self.finish_param_sync()
        # Buckets are laid out in backward order: start those the forward reaches first.
        for bucket in reversed(self.buckets):
            if bucket.shards > 1:
                bucket.gather = all_gather_flat(
                    bucket.param_data,
                    self._shard(bucket, bucket.param_data),
                    group=bucket.group,
                    async_op=True,
                )
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight."""
        for bucket in self.buckets:
            _wait_gather(bucket)

    def _params_needed(self, module: nn.Module, args) -> None:
        for p in module.parameters(recurse=False):
            bucket = self._bucket_of.get(id(p))
            if bucket is not None:
                _wait_gather(bucket)

    def zero_grad_buffer(self) -> None:
        """Zero every main_grad before the next step's first microbatch."""
        for buffer in self.buffers:
            buffer.grad_data.zero_()
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.handle = None
        for p in self.module.parameters():
            p.grad = None


def _wait_gather(bucket: Bucket) -> None:
    if bucket.gather is not None:
        bucket.gather.wait()
        bucket.gather = None
