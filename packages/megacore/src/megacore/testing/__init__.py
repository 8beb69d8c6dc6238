"""Test doubles for multi-process code, stricter than production so they prove something.

- `run_distributed` (processes.py): call a function on N spawned ranks of a real
  process group and get their results, or one error naming the rank that failed.
- `nccl_semantics` (nccl.py): make gloo behave as NCCL does where gloo forgives:
  batched sends/receives complete only against the peer's matching batch, and
  every tensor handed to a collective is on the rank's device and contiguous.
  `run_distributed` turns it on for every rank unless told not to.
- `count_tp_collectives` (collectives.py): count the tensor-parallel collectives a
  forward and backward issue, by kind.
- `emulate_make_graphed_callables` (cuda_graphs.py): torch.cuda.make_graphed_callables'
  static memory on any device, its hazards made loud (NaN warm-up gradients, outputs and
  activations replaced by the next replay).
"""

from megacore.testing.collectives import count_tp_collectives
from megacore.testing.cuda_graphs import emulate_make_graphed_callables
from megacore.testing.nccl import NCCLSemanticsError, nccl_semantics
from megacore.testing.processes import DistributedTestError, run_distributed

__all__ = [
    "DistributedTestError",
    "NCCLSemanticsError",
    "count_tp_collectives",
    "emulate_make_graphed_callables",
    "nccl_semantics",
    "run_distributed",
]
