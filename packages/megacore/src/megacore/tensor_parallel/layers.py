"""Tensor-parallel layers: column- and row-parallel linear, vocabulary-parallel embedding.

Initialization draws the full (unsharded) weight on the CPU, in float32, and
keeps this rank's slice, so for one seed a model at TP=k holds exactly the
weights it holds at TP=1 and computes the same function.  Every rank draws the
same full tensor, so the generator advances identically on all TP ranks
whatever their number.  The draw comes from `generator` (a CPU
`torch.Generator`) when one is given, so building a model need not touch (or
reseed) the global generators; without one it comes from the default CPU
generator, as in Megatron.  The parameters themselves are allocated on `device`
in `params_dtype` and the slice copied there: the CPU draw is what makes a
model built on a GPU hold the same numbers as one built on the CPU (CUDA
generators draw other streams), at the cost of one full-size draw per weight.

Like Megatron's, the linear layers return `(output, bias)`: `bias` is None
unless `skip_bias_add=True`, in which case the caller adds it (to fuse it with
what follows).  With `sequence_parallel=True` activations outside the layers are
sharded along the sequence (first) dimension: the column-parallel layer
all-gathers its input and the row-parallel layer reduce-scatters its output; with
`tp_comm_overlap=True` too, those collectives run as rings of point-to-point steps
overlapped with the GEMM (`tensor_parallel.comm_overlap`).
"""

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megacore import parallel_state
from megacore.tensor_parallel.comm_overlap import all_gather_matmul, matmul_reduce_scatter
from megacore.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megacore.tensor_parallel.utils import (
    divide,
    set_tensor_model_parallel_attributes,
    shard_of,
    vocab_range,
)
from megacore.tensor_parallel.weight_grad import linear

# init_method(tensor) fills `tensor` in place; it must also accept `generator=` (a
# torch.Generator) to be used by a layer given a generator.
InitMethod = Callable[..., torch.Tensor]


def init_method_normal(sigma: float = 0.02) -> InitMethod:
    """N(0, sigma), the paper's initialization; from `generator`, or the default one."""

    def init_(tensor, generator: torch.Generator | None = None):
        return nn.init.normal_(tensor, mean=0.0, std=sigma, generator=generator)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> InitMethod:
    """N(0, sigma / sqrt(2 num_layers)) for the output layers that feed a residual."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def _tp_size_and_rank() -> tuple[int, int]:
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


def _draw_on_cpu(
    tensor: torch.Tensor, init_method: InitMethod, generator: torch.Generator | None
) -> torch.Tensor:
    """`init_method(tensor)` from `generator`, or from the default CPU generator when None.

    The generator must be a CPU one: weights are drawn on the CPU whatever their
    device (see the module docstring), so its numbers do not depend on the device.
    """
    if generator is None:
        return init_method(tensor)
    if generator.device.type != "cpu":
        raise ValueError(
            f"megacore.tensor_parallel: the initialization generator is on {generator.device}; "
            "weights are drawn on the CPU (the same numbers on every device), so pass a CPU "
            "torch.Generator"
        )
    return init_method(tensor, generator=generator)


def _sharded_weight(
    full_shape: tuple[int, int],
    partition_dim: int,
    stride: int,
    init_method: InitMethod | None,
    perform_initialization: bool,
    dtype: torch.dtype,
    device,
    generator: torch.Generator | None,
) -> nn.Parameter:
    """This rank's slice of a weight split along `partition_dim`, marked as a TP shard.

    Allocated on `device` in `dtype` and initialized (unless `perform_initialization`
    is False, e.g. before loading a checkpoint) as the slice of the full float32
    weight drawn on the CPU from `generator`.
    """
    world, rank = _tp_size_and_rank()
    shape = list(full_shape)
    shape[partition_dim] //= world
    weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
    if perform_initialization:
        master = torch.empty(full_shape, dtype=torch.float32)
        _draw_on_cpu(master, init_method or init_method_normal(), generator)
        with torch.no_grad():
            weight.copy_(shard_of(master, partition_dim, rank, world, stride))
    return weight


def _zero_bias(size, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(size, dtype=dtype, device=device))


def _overlaps(layer: nn.Module, weight: torch.Tensor, float8) -> bool:
    """Whether `layer`'s sequence-parallel collective runs overlapped with its GEMM: asked for,
    and not in float8 (whose GEMM takes the gathered input whole)."""
    in_float8 = float8 is not None and float8.applies_to(weight)
    return layer.sequence_parallel and layer.tp_comm_overlap and not in_float8


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split along its output (column) dimension over the TP ranks.

    Input is replicated on every TP rank (or sequence-sharded with
    `sequence_parallel`); output is this rank's columns, or all of them with
    `gather_output=True`.  `stride` > 1 splits each of `stride` stacked blocks of
    the output (e.g. [q; k; v]) separately.  With `skip_weight_param_allocation`
    the weight is passed to `forward` (an output layer tied to the embedding).
    Parameters live on `device` in `params_dtype`; the weight is drawn from the CPU
    `generator` (the default CPU generator when None).  `tp_comm_overlap` (with
    `sequence_parallel`): the all-gather overlapped with the GEMM (`all_gather_matmul`).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        *,
        init_method: InitMethod | None = None,
        stride: int = 1,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        skip_weight_param_allocation: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        perform_initialization: bool = True,
        generator: torch.Generator | None = None,
        tp_comm_overlap: bool = False,
    ):
        super().__init__()
        world, _ = _tp_size_and_rank()
        if sequence_parallel and gather_output:
            raise ValueError(
                "ColumnParallelLinear: sequence_parallel=True needs gather_output=False"
            )
        self.input_size, self.output_size = input_size, output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.float8 = None  # a tensor_parallel.float8.Float8Recipe: the GEMMs in float8
        self.sequence_parallel = sequence_parallel and world > 1
        # Read at each forward (megatrain's apply_tp_comm_overlap sets it on built layers).
        self.tp_comm_overlap = tp_comm_overlap
        self.output_size_per_partition = (
            divide(
                output_size,
                world * stride,
                "ColumnParallelLinear output_size",
                f"tensor_model_parallel_size x stride ({world} x {stride})",
            )
            * stride
        )
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = _sharded_weight(
                (output_size, input_size), 0, stride, init_method, perform_initialization,
                params_dtype, device, generator,
            )  # fmt: skip
        if bias:
            self.bias = _zero_bias(self.output_size_per_partition, params_dtype, device)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None):
        if weight is None:
            if self.weight is None:
                raise ValueError(
                    "ColumnParallelLinear: built with skip_weight_param_allocation=True, so "
                    "forward needs weight="
                )
            weight = self.weight
        elif weight.shape != (self.output_size_per_partition, self.input_size):
            raise ValueError(
                f"ColumnParallelLinear: weight passed to forward has shape {tuple(weight.shape)}, "
                f"expected {(self.output_size_per_partition, self.input_size)}"
            )
        bias = None if self.skip_bias_add else self.bias
        # Its own weight may take gradient-accumulation fusion or float8; a passed one (tied)
        # may not.
        own = weight is self.weight
        float8 = self.float8 if own else None
        if _overlaps(self, weight, float8):
            out = all_gather_matmul(input_, weight, accumulate=own)
            if bias is not None:
                out = out + bias
        else:
            x = self.parallel_input(input_)
            out = linear(x, weight, bias, accumulate=own, float8=float8)
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out)
        return out, (self.bias if self.skip_bias_add else None)

    def parallel_input(self, input_: torch.Tensor) -> torch.Tensor:
        """The input as this rank's matmul takes it: copied into the tensor-parallel region
        (its gradient all-reduced), or gathered from the sequence-parallel one."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True)
        return copy_to_tensor_model_parallel_region(input_)

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, "
            f"per_partition={self.output_size_per_partition}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}, tp_comm_overlap={self.tp_comm_overlap}"
        )


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split along its input (row) dimension over the TP ranks.

    Input is this rank's columns of X (`input_is_parallel=True`, the output of a
    column-parallel layer) or the full X, which is then split.  The partial
    products are summed over the TP group (all-reduce, or reduce-scatter along the
    sequence with `sequence_parallel`), then the bias, which is replicated, is added.
    Parameters live on `device` in `params_dtype`; the weight is drawn from the CPU
    `generator` (the default CPU generator when None).  `tp_comm_overlap` (with
    `sequence_parallel`): the reduce-scatter overlapped with the GEMM
    (`matmul_reduce_scatter`).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        *,
        init_method: InitMethod | None = None,
        stride: int = 1,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        perform_initialization: bool = True,
        generator: torch.Generator | None = None,
        tp_comm_overlap: bool = False,
    ):
        super().__init__()
        world, _ = _tp_size_and_rank()
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True"
            )
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.float8 = None  # a tensor_parallel.float8.Float8Recipe: the GEMMs in float8
        self.sequence_parallel = sequence_parallel and world > 1
        # Read at each forward (megatrain's apply_tp_comm_overlap sets it on built layers).
        self.tp_comm_overlap = tp_comm_overlap
        self.input_size_per_partition = (
            divide(
                input_size,
                world * stride,
                "RowParallelLinear input_size",
                f"tensor_model_parallel_size x stride ({world} x {stride})",
            )
            * stride
        )
        self.weight = _sharded_weight(
            (output_size, input_size), 1, stride, init_method, perform_initialization,
            params_dtype, device, generator,
        )  # fmt: skip
        if bias:
            self.bias = _zero_bias(output_size, params_dtype, device)
            # Replicated on TP ranks; under sequence parallelism each rank's gradient is partial.
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        x = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_)
        if _overlaps(self, self.weight, self.float8):
            out = matmul_reduce_scatter(x, self.weight, accumulate=True)
        elif self.sequence_parallel:
            out = linear(x, self.weight, accumulate=True, float8=self.float8)
            out = reduce_scatter_to_sequence_parallel_region(out)
        else:
            out = linear(x, self.weight, accumulate=True, float8=self.float8)
            out = reduce_from_tensor_model_parallel_region(out)
        if self.skip_bias_add or self.bias is None:
            return out, self.bias if self.skip_bias_add else None
        return out + self.bias, None

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, "
            f"per_partition={self.input_size_per_partition}, "
            f"input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}, tp_comm_overlap={self.tp_comm_overlap}"
        )


class VocabParallelEmbedding(nn.Module):
    """Word embeddings split along the vocabulary over the TP ranks.

    Each rank looks up the ids in its range, zeroes the others, and the partial
    embeddings are summed over the TP group.  The vocabulary must divide by TP:
    pad it with `vocab_size_with_padding`.  The weight lives on `device` in
    `params_dtype` and is drawn from the CPU `generator` (the default one when None).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        perform_initialization: bool = True,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        world, rank = _tp_size_and_rank()
        if num_embeddings % world:
            raise ValueError(
                f"VocabParallelEmbedding: num_embeddings ({num_embeddings}) is not divisible by "
                f"tensor_model_parallel_size ({world}); pad the vocabulary, e.g. with "
                "megacore.tensor_parallel.vocab_size_with_padding"
            )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start_index, self.vocab_end_index = vocab_range(num_embeddings, rank, world)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = _sharded_weight(
            (num_embeddings, embedding_dim), 0, 1, init_method, perform_initialization,
            params_dtype, device, generator,
        )  # fmt: skip

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(input_ids, self.weight, self.vocab_start_index)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"range=[{self.vocab_start_index}, {self.vocab_end_index})"
        )


def vocab_parallel_embedding(
    input_ids: torch.Tensor, weight: torch.Tensor, vocab_start_index: int
) -> torch.Tensor:
    """`VocabParallelEmbedding`'s lookup in `weight`, this rank's rows of the vocabulary from
    `vocab_start_index`: a module's own, or a copy of the word embeddings kept elsewhere (a
    last pipeline stage's, which multi-token prediction embeds with)."""
    world, _ = _tp_size_and_rank()
    if world == 1:
        return F.embedding(input_ids, weight)
    end = vocab_start_index + weight.size(0)
    outside = (input_ids < vocab_start_index) | (input_ids >= end)
    local_ids = (input_ids - vocab_start_index).masked_fill(outside, 0)
    out = F.embedding(local_ids, weight).masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tensor_model_parallel_region(out)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's sharded gradients), sharing its storage; any other
    tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()


def sync_sequence_parallel_grads(module: nn.Module) -> None:
    """All-reduce over TP the gradients of parameters marked `sequence_parallel`.

    Under sequence parallelism a replicated parameter used on a sequence shard
    (LayerNorm weights, the row-parallel bias) gets only its shard's share of the
    gradient on each rank; so does any replicated parameter each rank uses for part of
    the work (grouped-query attention's key/value projection with fewer groups than
    ranks).  Call after backward, before clipping and the step.  Model code marks such
    parameters with `param.sequence_parallel = True`.
    """
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [
        getattr(p, "main_grad", p.grad)
        for p in module.parameters()
        if getattr(p, "sequence_parallel", False)
    ]
    # FSDP2's gradients are DTensors: their local shards, laid out alike on every TP rank (the
    # parameters have one shape there), are what the TP ranks sum, after the DP reduction.
    grads = [local_tensor(g) for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
