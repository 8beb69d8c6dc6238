"""Data parallelism with gradients accumulated into contiguous buffers (Megatron-LM's DDP).

Each parameter's gradient lives in `param.main_grad`, a view into one flat
buffer per gradient dtype (fp32 for bf16/fp16 models with
`grad_reduce_in_fp32=True`).  Parameters are laid out in reverse order of
registration, which is close to the order backward produces their gradients,
and the buffer is cut into buckets of about `bucket_size` elements.  A hook
after each gradient accumulation adds `param.grad` into `main_grad` and frees
`param.grad`.  On the last microbatch (outside `no_sync()`) a bucket is
all-reduced over the data-parallel group as soon as all its gradients are in
(`overlap_grad_reduce=True`), or all buckets at `finish_grad_sync()`.
Gradients are averaged: each rank scales by 1/dp before the sum.
"""

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megacore import parallel_state as ps


@dataclass
class _Bucket:
    buffer: torch.Tensor  # a view into the dtype's flat buffer
    params: set = field(default_factory=set)
    ready: set = field(default_factory=set)
    handle: object = None


class DistributedDataParallel(nn.Module):
    def __init__(
        self,
        module: nn.Module,
        *,
        grad_reduce_in_fp32: bool = False,
        overlap_grad_reduce: bool = False,
        bucket_size: int = 40_000_000,
        data_parallel_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        if bucket_size < 1:
            raise ValueError(
                f"DistributedDataParallel: bucket_size must be >= 1, got {bucket_size}"
            )
        self.module = module
        self.overlap_grad_reduce = overlap_grad_reduce
        self.group = data_parallel_group or ps.get_data_parallel_group()
        self.dp_size = dist.get_world_size(self.group)
        self.sync_enabled = True
        params = [p for p in module.parameters() if p.requires_grad]
        params = list(dict.fromkeys(params))[::-1]  # unique, roughly in backward order
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            dtype = torch.float32 if grad_reduce_in_fp32 else p.dtype
            by_dtype.setdefault(dtype, []).append(p)
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        for dtype, group_params in by_dtype.items():
            total = sum(p.numel() for p in group_params)
            buffer = torch.zeros(total, dtype=dtype, device=group_params[0].device)
            self.buffers[dtype] = buffer
            offset, bucket_start, members = 0, 0, []
            for i, p in enumerate(group_params):
                p.main_grad = buffer[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                members.append(p)
                if offset - bucket_start >= bucket_size or i == len(group_params) - 1:
                    bucket = _Bucket(buffer[bucket_start:offset], {id(m) for m in members})
                    self.buckets.append(bucket)
                    for m in members:
                        self._bucket_of[id(m)] = bucket
                    bucket_start, members = offset, []
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]

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
        param.main_grad.add_(param.grad)
        param.grad = None
        if not (self.sync_enabled and self.overlap_grad_reduce):
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        if bucket.ready == bucket.params and bucket.handle is None:
            self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        if self.dp_size == 1:
            bucket.handle = True
            return
        bucket.buffer.div_(self.dp_size)
        bucket.handle = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

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

    def zero_grad_buffer(self) -> None:
        """Zero every main_grad before the next step's first microbatch."""
        for buffer in self.buffers.values():
            buffer.zero_()
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.handle = None
        for p in self.module.parameters():
            p.grad = None
