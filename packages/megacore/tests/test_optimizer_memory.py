"""Bytes of parameters, gradients and optimizer state per model parameter, by the table:

| model params, grads  | plain optimizer | distributed optimizer |
| fp16, fp16           | 20              | 4 + 16/d              |
| fp16, fp32           | 18              | 6 + 12/d              |
| fp32, fp32           | 16              | 8 + 8/d               |

Counted on each rank after a real step, from the storages the model, the DDP
buffers and the optimizer hold (each storage once), for d = 1, 2, 4.
"""

import torch
import torch.distributed as dist
from tiny_stack import TinyConfig, TinyStack

from megacore import parallel_state as ps
from megacore import pipeline_parallel as pipe
from megacore import tensor_parallel as tp
from megacore.distributed import DistributedDataParallel
from megacore.optimizer import MegatronOptimizer, OptimizerConfig
from megacore.testing import run_distributed

CFG = TinyConfig(vocab_size=256, hidden=128, ffn=512, layers=2)
CASES = {  # (param dtype, fp32 grads): (plain bytes, (sharded constant, sharded per 1/d))
    (torch.float16, False): (20, (4, 16)),
    (torch.float16, True): (18, (6, 12)),
    (torch.float32, True): (16, (8, 8)),
}


def _storages_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _bytes_per_param(model, ddp, optimizer) -> float:
    inner = optimizer.optimizer
    masters = [p for group in inner.param_groups for p in group["params"]]
    tensors = [
        *model.parameters(),
        *(b.grad_data for b in ddp.buffers),
        *masters,
        *(m.grad for m in masters),
        *(v for state in inner.state.values() for v in state.values() if v.dim() > 0),
    ]
    return _storages_bytes(tensors) / sum(p.numel() for p in model.parameters())


def _measure():
    ps.initialize_model_parallel(1, 1)
    rank = dist.get_rank()
    groups = {}
    for d in (1, 2, 4):  # every rank creates every group, in the same order
        for start in range(0, 4, d):
            group = dist.new_group(list(range(start, start + d)))
            if start <= rank < start + d:
                groups[d] = group
    out = {}
    for (dtype, fp32_grads), _ in CASES.items():
        for d, group in groups.items():
            for sharded in (False, True):
                tp.model_parallel_manual_seed(0)
                model = TinyStack(CFG).to(dtype)
                ddp = DistributedDataParallel(
                    model,
                    grad_reduce_in_fp32=fp32_grads,
                    use_distributed_optimizer=sharded,
                    data_parallel_group=group,
                )
                config = OptimizerConfig(
                    fp16=dtype == torch.float16,
                    initial_loss_scale=2.0**8,
                    use_distributed_optimizer=sharded,
                )
                optimizer = MegatronOptimizer(config, [ddp])
                tokens = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator())
                pipe.get_forward_backward_func()(
                    forward_step_func=lambda it, m: (m(*next(it)), lambda loss: (loss, {})),
                    data_iterator=iter([(tokens[:, :-1], tokens[:, 1:])]),
                    model=ddp,
                    num_microbatches=1,
                    seq_length=8,
                    micro_batch_size=2,
                    grad_scale_func=optimizer.scale_loss,
                    finalize_model_grads_func=pipe.finalize_model_grads,
                )
                ok, _, _ = optimizer.step()
                out[(dtype, fp32_grads, d, sharded)] = (ok, _bytes_per_param(model, ddp, optimizer))
    ps.destroy_model_parallel()
    return out


def test_bytes_per_parameter_match_the_optimizer_table():
    for rank, out in enumerate(run_distributed(_measure, world_size=4, timeout=300)):
        for (dtype, fp32_grads), (plain, (const, per_d)) in CASES.items():
            for d in (1, 2, 4):
                for sharded, want in ((False, plain), (True, const + per_d / d)):
                    ok, got = out[(dtype, fp32_grads, d, sharded)]
                    where = f"rank {rank}: {dtype} fp32 grads={fp32_grads} d={d} sharded={sharded}"
                    assert ok, where  # a real step, so every state tensor exists
                    assert abs(got - want) <= 0.05 * want, f"{where}: {got:.3f} vs {want}"
