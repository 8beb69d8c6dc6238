"""Flat-tensor collectives under the names of the installed torch.

torch renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to
`all_gather_single` / `reduce_scatter_single`; both take (output, input, group=...).
"""

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
