"""Everything one rank holds while training (`Run`), built from a run config: process groups,
the corpus splits, the model chunks wrapped for data parallelism, the optimizer and this
rank's batches.
"""

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore.optimizer import MegatronOptimizer, OptimizerConfig
from megatrain.config import PACKING_SWITCHES, Config, validate
from megatrain.data.blend import BlendedBatches, OpenBlend, open_run_blend
from megatrain.data.samples import GPTBatches, PackedDocuments
from megatrain.models import build_model_chunks, model_config
from megatrain.models.transformer_config import TransformerConfig
from megatrain.parallelize import PRECISION_DTYPES, check_device_support, parallelize_model


@dataclass
class Run:
    """Everything one rank holds while training."""

    config: Config
    model_config: TransformerConfig
    chunks: list
    optimizer: MegatronOptimizer
    train_data: "GPTBatches"  # or bert_data.BertBatches, or a BlendedBatches of either
    valid_data: "OpenBlend"  # the valid split's corpora (one, or a blend's)
    device: torch.device
    dtype: torch.dtype
    dp_size: int
    iteration: int = 0
    history: dict = field(default_factory=lambda: {"loss": [], "valid": [], "grad_norm": []})

    @property
    def kind(self) -> str:
        return self.config.model.kind

    @property
    def num_microbatches(self) -> int:
        t = self.config.training
        return t.global_batch_size // (t.micro_batch_size * self.dp_size)


def batches_for(config: Config, data: "OpenBlend", dp: int):
    """This data-parallel rank's microbatches of a split, in the paper's order (of a blend:
    each corpus's samples in that order, interleaved by the blending rule)."""
    t, d = config.training, config.data
    batch = {"global_batch_size": t.global_batch_size, "micro_batch_size": t.micro_batch_size}
    rank = {"dp_rank": ps.get_data_parallel_rank(), "dp_size": dp}

    def sampler(corpus, **slicing):
        common = {"seq_len": t.seq_length, "seed": t.seed, **batch, **slicing}
        if config.model.kind == "bert":
            from megatrain.data.bert import BertBatches

            return BertBatches(
                corpus,
                **common,
                masked_lm_prob=d.masked_lm_prob,
                max_ngram=d.max_ngram,
                short_seq_prob=d.short_seq_prob,
            )
        packing = PackedDocuments(*(getattr(d, n) for n in PACKING_SWITCHES))
        return GPTBatches(corpus, **common, packing=packing)

    if not data.is_blend:
        return sampler(data.first, **rank)
    # Each corpus's sampler only gives its samples; the blend slices them among the ranks.
    sources = [sampler(c) for c in data.corpora]
    return BlendedBatches(data.entries, sources, **batch, **rank)


def prepare_training(config: Config, chunks: list) -> tuple[list, MegatronOptimizer]:
    """Built model chunks ready to train as `config` says (`parallelize_model`: every step of
    the run's parallelism, in its order, ending wrapped for data parallelism) and the
    optimizer over them.  Shared by pretraining and fine-tuning (megaeval)."""
    chunks = parallelize_model(chunks, config)
    return chunks, build_optimizer(config, chunks)


def build_optimizer(config: Config, chunks: list) -> MegatronOptimizer:
    """Megatron's optimizer over the wrapped chunks (the distributed optimizer's shards with
    `parallel.use_distributed_optimizer`; FSDP's sharded fp32 parameters updated in place)."""
    p, t, o = config.parallel, config.training, config.optimizer
    return MegatronOptimizer(
        OptimizerConfig(
            lr=o.lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            fp16=t.precision == "fp16",
            bf16=t.precision in ("bf16", "fp8"),
            loss_scale=o.loss_scale,
            initial_loss_scale=o.initial_loss_scale,
            min_loss_scale=o.min_loss_scale,
            loss_scale_window=o.loss_scale_window,
            hysteresis=o.hysteresis,
            use_distributed_optimizer=p.use_distributed_optimizer,
            step_on_device=t.one_sync_per_iteration,
        ),
        chunks,
    )


def build_run(config: Config, device: torch.device) -> Run:
    """Parallel groups, model chunks wrapped in DDP, optimizer and data for this rank."""
    dp = validate(config, dist.get_world_size())
    p, t = config.parallel, config.training
    vpp = p.virtual_pipeline_model_parallel_size
    ps.initialize_model_parallel(
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        vpp if vpp and vpp > 1 else None,
        timeout=datetime.timedelta(seconds=p.collective_timeout),
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
    )
    # Shards verified once per node (`megatrain run` itself verifies before its workers start
    # and hands them a config that says so).
    verify = config.data.verify_sha256 and int(os.environ.get("LOCAL_RANK", "0")) == 0
    train_corpora = open_run_blend(config, "train", verify)
    valid_data = open_run_blend(config, "valid", verify)
    transformer = model_config(config, train_corpora.first.vocab_size)
    dtype = PRECISION_DTYPES[t.precision]
    check_device_support(config, device)  # before any weight is built
    # Built in place (on `device`, in `dtype`): the tied-embedding sync inside runs on the
    # device (NCCL needs that at pp > 1), and no weight passes through a second copy.
    chunks = build_model_chunks(config.model.kind, transformer, t.seed, device=device, dtype=dtype)
    chunks, optimizer = prepare_training(config, chunks)
    train_data = batches_for(config, train_corpora, dp)
    return Run(config, transformer, chunks, optimizer, train_data, valid_data, device, dtype, dp)
