"""The smallest model that exercises every piece of megacore, for the runtime's tests.

Not a transformer: megatrain owns the model (its layer, attention and heads are tested
there at every layout).  This stack holds just what megacore provides and must get right
under every layout: a vocabulary-parallel embedding, blocks of LayerNorm -> column-parallel
-> GeLU -> row-parallel with a residual (Fig. 4's f and g: one all-reduce forward and one
backward per block; sequence parallelism's all-gather and reduce-scatter), dropout on the
tensor-parallel hidden units under the RNG tracker and on the residual, recompute, an
output layer tied to the embedding across pipeline stages, and the vocabulary-parallel
cross entropy.  Activations are [sequence, batch, hidden].
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megacore import parallel_state, pipeline_parallel
from megacore import tensor_parallel as tp
from megacore.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_world_size,
)


@dataclass
class TinyConfig:
    vocab_size: int = 64
    hidden: int = 32
    ffn: int = 128
    layers: int = 2
    dropout: float = 0.0
    sequence_parallel: bool = False
    recompute: bool = False
    distribute_saved_activations: bool = False


def _mark_sequence_parallel(module: nn.Module, on: bool) -> None:
    for p in module.parameters():
        p.sequence_parallel = on


class Block(nn.Module):
    """x + dropout(fc2(dropout(gelu(fc1(ln(x)))))), fc1 column- and fc2 row-parallel.

    Weights drawn in order (fc1, fc2) from the CPU `generator`, or from the default CPU
    generator when None (tests that build blocks directly seed that one)."""

    def __init__(self, cfg: TinyConfig, generator: torch.Generator | None = None):
        super().__init__()
        h, sp = cfg.hidden, cfg.sequence_parallel
        self.cfg = cfg
        tp.divide_by_tp(cfg.ffn, "ffn_hidden_size")
        self.ln = nn.LayerNorm(h)
        _mark_sequence_parallel(self.ln, sp)
        self.fc1 = tp.ColumnParallelLinear(h, cfg.ffn, sequence_parallel=sp, generator=generator)
        self.fc2 = tp.RowParallelLinear(
            cfg.ffn, h, input_is_parallel=True, sequence_parallel=sp,
            init_method=tp.scaled_init_method_normal(0.02, cfg.layers), generator=generator,
        )  # fmt: skip

    def forward(self, x):
        hidden, _ = self.fc1(self.ln(x))
        hidden = F.gelu(hidden)
        if self.training and self.cfg.dropout:
            with tp.get_rng_tracker().fork():  # each TP rank holds other units: its own mask
                hidden = F.dropout(hidden, self.cfg.dropout)
        out, _ = self.fc2(hidden)
        if self.training and self.cfg.dropout:
            if self.cfg.sequence_parallel:  # each rank holds other tokens: its own mask
                with tp.get_rng_tracker().fork():
                    out = F.dropout(out, self.cfg.dropout)
            else:  # the same mask on every TP rank
                out = F.dropout(out, self.cfg.dropout)
        return x + out


class TinyStack(nn.Module):
    """The whole model, or one pipeline chunk of it (`layer_ids`, `pre_process`, `post_process`).

    Each piece is drawn from its own CPU generator (seeded seed + 1 + layer id for a
    block), so a chunk built on any pipeline rank holds the weights the whole model
    holds, and building leaves the global generators (dropout's) as they were.
    A last stage without the embedding keeps its own copy of the word embeddings
    for the output layer, marked `shared_embedding` (pipeline_parallel syncs it).
    """

    def __init__(self, cfg, layer_ids=None, pre_process=True, post_process=True, seed=1234):
        super().__init__()
        self.cfg = cfg
        self.pre_process, self.post_process = pre_process, post_process
        self.input_tensor = None
        if pre_process:
            self.embedding = tp.VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden, generator=torch.Generator().manual_seed(seed)
            )
        layer_ids = range(cfg.layers) if layer_ids is None else layer_ids
        self.blocks = nn.ModuleDict(
            {str(i): Block(cfg, torch.Generator().manual_seed(seed + 1 + i)) for i in layer_ids}
        )
        if post_process:
            self.ln_f = nn.LayerNorm(cfg.hidden)
            _mark_sequence_parallel(self.ln_f, cfg.sequence_parallel)
            self.output = tp.ColumnParallelLinear(
                cfg.hidden,
                cfg.vocab_size,
                bias=False,
                sequence_parallel=cfg.sequence_parallel,
                skip_weight_param_allocation=True,
            )
            if pre_process:
                self.output_weight = None  # the embedding itself
            else:
                rows = tp.divide_by_tp(cfg.vocab_size, "vocab_size")
                self.output_weight = nn.Parameter(torch.zeros(rows, cfg.hidden))
                tp.set_tensor_model_parallel_attributes(self.output_weight, True, 0)
                self.output_weight.shared_embedding = True
        if pre_process and not post_process:
            self.embedding.weight.shared_embedding = True

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def run_blocks(self, x):
        for block in self.blocks.values():
            if self.cfg.recompute:
                x = tp.checkpoint(block, self.cfg.distribute_saved_activations, x)
            else:
                x = block(x)
        return x

    def logits(self, tokens):
        """tokens: [batch, seq] -> this rank's vocabulary slice of the logits: [seq, batch, v/tp]"""
        if self.pre_process:
            x = self.embedding(tokens).transpose(0, 1).contiguous()  # [s, b, h]
            if self.cfg.sequence_parallel:
                x = tp.scatter_to_sequence_parallel_region(x)
        else:
            x = self.input_tensor
        x = self.run_blocks(x)
        if not self.post_process:
            return x
        weight = self.embedding.weight if self.output_weight is None else self.output_weight
        logits, _ = self.output(self.ln_f(x), weight=weight)
        return logits

    def forward(self, tokens, targets):
        """tokens, targets: [batch, seq] -> mean loss (or, before the last stage, activations)."""
        out = self.logits(tokens)
        if not self.post_process:
            return out
        return tp.vocab_parallel_cross_entropy(out, targets.t()).mean()


def full_tensor(param: torch.Tensor, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The unsharded value of a parameter (or of a tensor sharded like it, e.g. its grad)."""
    tensor = param if tensor is None else tensor
    world = get_tensor_model_parallel_world_size()
    if not getattr(param, "tensor_model_parallel", False) or world == 1:
        return tensor.detach().clone()
    tensor = tensor.detach().contiguous()  # empty_like keeps strides: NCCL takes contiguous only
    shards = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(shards, tensor, group=get_tensor_model_parallel_group())
    return tp.unshard(shards, param.partition_dim, param.partition_stride)


def build_chunks(cfg, pp, vpp):
    """This rank's pipeline chunks of the model, with the tied embedding copies synced."""
    chunks = []
    for v in range(vpp or 1):
        layer_ids = pipeline_parallel.layers_for(
            cfg.layers, parallel_state.get_pipeline_model_parallel_rank(), pp, vpp, virtual_rank=v
        )
        if vpp:
            parallel_state.set_virtual_pipeline_model_parallel_rank(v)
        chunks.append(
            TinyStack(
                cfg,
                layer_ids,
                pre_process=parallel_state.is_pipeline_first_stage(),
                post_process=parallel_state.is_pipeline_last_stage(),
            )
        )
    if vpp:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    pipeline_parallel.sync_shared_embeddings(chunks)
    return chunks
