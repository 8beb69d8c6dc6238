"""Memory per GPU of a training config, and the cheapest recompute mode that fits a GPU.

An estimate of the steady state of training, per pipeline stage, in bytes:

- **Weights and optimizer**: this stage's parameters on one TP rank (the sharded
  matrices / tp, the replicated biases and LayerNorms whole;
  `accounting.parameters_per_gpu`) times the bytes per parameter of megacore's optimizer
  (`accounting.state_bytes_per_parameter`): fp32 16, fp16/bf16 18, the fp32 state
  sharded over data parallelism under `use_distributed_optimizer`; under
  `data_parallel_sharding = "full"` (FSDP2) 16/d, plus what FSDP gathers for compute
  and the unsharded gradients it holds ("gathered": `accounting.fsdp_gathered_bytes`; every
  parameter's fp32 gradient over a step's microbatches unless
  `parallel.reduce_every_microbatch`).
- **Activations**: Korthikanti et al. 2022's bytes per layer per microbatch
  (`accounting.activations_per_layer`: none, selective, full) times the stage's layers
  times the microbatches in flight: under 1F1B stage 0 holds pp of them (interleaved:
  times 1 + (pp - 1) / (pp vpp)), the last stage one; without pipelining one.  ZB-H1
  holds as many between forward and B, and stage r besides keeps r microbatches' weight
  gradient inputs (`accounting.weight_grad_inputs_per_layer`, each about a microbatch's
  activations without recompute) until their deferred W: the first stage as under 1F1B,
  the last one close to pp microbatches, and recompute saves nothing on those.  Stage 0
  adds the embedding dropout mask (s b h per microbatch, / t with sequence parallelism;
  none, as no layer's masks, without `model.hidden_dropout`);
  the last stage the output layer's input, the final LayerNorm's and the fp32 logits the
  loss keeps (the paper's 4 s b h / t (1 + v / h)); with `training.fused_linear_cross_entropy`
  instead the output layer's input and its gradient (4 s b h), its weight's fp32 gradient
  (4 v h / t) and one chunk's fp32 logits; with multi-token prediction each depth's layer,
  inputs and logits besides (`mtp_activations`).  With `training.cuda_graphs` each layer adds its
  static input copy and output (4 s b h, / t with sequence parallelism) and, without
  gradient-accumulation fusion, its weights' gradients.  Under "full" the layer being
  recomputed holds one layer's "none" activations besides.  fp32 activations count
  twice the 16-bit bytes.
- **Mixture of experts** (`model.num_moe_experts`): a MoE layer's weights are its E / ep
  experts, each / etp (`accounting.expert_parameters_per_gpu`), besides the router and
  shared expert; their gradients and optimizer state as the dense ones', the distributed
  optimizer sharding them over the expert data-parallel group (tp x cp x dp / (etp x ep)
  ranks of a stage) instead of dp x cp.  Its activations put the router's fp32 logits, the
  k permuted copies of each token and their expert tensors, and the shared expert's, in
  place of the dense MLP's (`accounting.moe_mlp_activations`, tokens spread evenly over the
  experts), and one layer's all-to-all buffers are held while it dispatches
  (`accounting.moe_dispatch_bytes`).  ZB-H1's deferred weight-gradient inputs are counted
  as a dense layer's.
- **Context parallelism** (`parallel.context_parallel_size` cp): every per-token
  activation above is the rank's s / cp tokens (exactly 1/cp of cp 1's bytes: the layers',
  the embedding's mask, the logits), and the attention over the whole sequence holds the
  other ranks' K/V and its masks or scores besides
  (`accounting.context_parallel_attention_per_layer`, by `parallel.cp_comm_type`): every
  layer under recompute "none", once (the layer being recomputed) under "selective" and
  "full"; and one layer's attention holds besides, while it runs, its boolean mask or the
  ring's float32 score gradients (`accounting.context_parallel_attention_working`).
  Weights, gradients and optimizer state do not change with cp: every CP rank
  holds the whole stage, as a data-parallel replica does, and the distributed optimizer
  shards its state over dp x cp (the gradients are reduced over both).

Host memory (not in the total): with `checkpoint.async_save` each rank keeps a copy of what
it saves, its weights and optimizer shard (`accounting.checkpoint_copy_bytes_per_parameter`),
as "host_checkpoint_copy".

Not counted: the CUDA context, library workspaces, communication buffers and
fragmentation; `fits` keeps a headroom (10%) for them.  The 5 a s / h term is what
attention that materializes its s x s scores keeps; the fused SDPA kernels (flash,
memory-efficient) keep only their output and a row statistic, so "none" is an
upper bound there and the choice it leads to a safe one.
"""

from types import SimpleNamespace

import torch

from megacore.tensor_parallel import default_chunk_tokens
from megatrain.config import RECOMPUTE_CHOICES, Config, pipeline_layer_counts
from megatrain.models import model_config
from megatrain.models.moe import is_moe_layer
from megatrain.models.transformer_config import TransformerConfig
from megatrain.plan.accounting import (
    MASKED_LM_PROB,
    RECOMPUTE_IMPLEMENTATIONS,
    activations_per_layer,
    checkpoint_copy_bytes_per_parameter,
    context_parallel_attention_per_layer,
    context_parallel_attention_working,
    expert_layout,
    expert_parameters_per_gpu,
    fsdp_gathered_bytes,
    layer_parameters_per_rank,
    moe_dispatch_bytes,
    mtp_layer_numbers,
    parameters_per_gpu,
    stage_layers,
    state_bytes_per_parameter,
    weight_grad_inputs_per_layer,
)
from megatrain.plan.hardware import GIB as GIB  # re-exported: sizes in GiB
from megatrain.plan.hardware import load_gpus

CUDA = torch.device("cuda")  # the estimate is for GPUs: their chunk of the fused loss

# Memory of the GPUs configs are sized for: the GPU table of `megatrain plan` (plan/gpus.toml).
GPU_MEMORY = {key: gpu.memory_bytes for key, gpu in load_gpus().items()}
HEADROOM = 0.1


def memory_breakdown(
    config: Config,
    recompute: str | None = None,
    *,
    vocab_size: int | None = None,
    data_parallel_size: int | None = None,
    stage: int = 0,
    attention: str = "unfused",
    model: TransformerConfig | None = None,
) -> dict[str, float]:
    """Bytes per GPU of pipeline stage `stage`: parameters (count; of them
    expert_parameters, the routed experts'), weights, gradients,
    optimizer_state, their sum weights_and_optimizer, activations, total; and the host bytes
    of a background save's copy (host_checkpoint_copy; 0 without checkpoint.async_save).
    `recompute` defaults to the config's; `vocab_size` (the tokenizer's, before padding) to
    `model.vocab_size`; the data-parallel size (which only the distributed optimizer's
    sharding depends on, over dp x cp) to `parallel.data_parallel_size`, else the least the
    expert layout allows (etp x ep / (tp x cp); 1 for a dense model).  `attention`:
    "unfused" (the s x s scores kept: the paper's kernels, and an upper bound on what a real
    run's SDPA keeps, which on a CPU may run its math path) or "flash" (`megatrain plan` on a
    GPU whose entry says so: `accounting.activations_per_layer`).  `model`: `config`'s
    `models.model_config` at `vocab_size`, where the caller has it (`cost_model.memory_per_gpu`
    weighs several stages of one config)."""
    m, p, t = config.model, config.parallel, config.training
    recompute = m.recompute if recompute is None else recompute
    if recompute not in (*RECOMPUTE_CHOICES, *RECOMPUTE_IMPLEMENTATIONS):
        raise ValueError(f"recompute must be one of {RECOMPUTE_CHOICES}, not {recompute!r}")
    vocab_size = vocab_size or m.vocab_size
    if not vocab_size:
        raise ValueError(
            "memory_breakdown: model.vocab_size is 0 (taken from the corpus); pass vocab_size="
        )
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    vpp = p.virtual_pipeline_model_parallel_size or 1
    cp = p.context_parallel_size
    cfg = model or model_config(config, vocab_size)
    ep, etp = expert_layout(config)
    # Unset, at least the data parallelism the expert layout needs (etp x ep ranks a stage).
    dp = data_parallel_size or p.data_parallel_size or max(1, ep * etp // (tp * cp))
    params = parameters_per_gpu(cfg, tp, pp, stage, ep, etp)
    experts = expert_parameters_per_gpu(cfg, pp, stage, ep, etp)
    # CP ranks hold whole replicas of the stage: the distributed optimizer shards over dp x cp;
    # the experts over their own data-parallel group, the etp x ep x edp ranks of a stage.
    full = p.data_parallel_sharding == "full"
    sharding = "full" if full else None
    dense = state_bytes_per_parameter(t.precision, p.use_distributed_optimizer, dp * cp, sharding)
    edp = max(1, dp * cp * tp // (ep * etp))
    expert = state_bytes_per_parameter(t.precision, p.use_distributed_optimizer, edp, sharding)
    held = {name: (params - experts) * dense[name] + experts * expert[name] for name in dense}
    if full:  # what FSDP gathers for compute (and accumulates unsharded), on top
        reshard = p.reshard_after_forward
        # the stage's dense and MoE layers (a MoE layer's with the rank's experts, each
        # gathered over the expert data-parallel group), and the largest of them
        dense_layers, moe_layers = stage_layers(cfg, pp, stage)
        sizes = [(layer_parameters_per_rank(cfg, tp), dense_layers)]
        if moe_layers:
            sizes.append((layer_parameters_per_rank(cfg, tp, True, ep, etp), moe_layers))
        held["gathered"] = fsdp_gathered_bytes(
            params,
            max((size for size, count in sizes if count), default=0),
            dense_layers + moe_layers,
            t.precision,
            pp == 1 if reshard is None else reshard,
            t.global_batch_size // (t.micro_batch_size * dp),
            p.reduce_every_microbatch,
            layers_params=sum(size * count for size, count in sizes),
        )
    state = sum(held.values())

    # The rank's tokens of each sequence: s / cp under context parallelism.
    s, b, h, v = t.seq_length // cp, t.micro_batch_size, m.hidden_size, cfg.vocab_size
    sp = p.sequence_parallel and tp > 1
    dense, moe = stage_layers(cfg, pp, stage)
    layers = dense + moe
    per_microbatch = (layers - moe) * activations_per_layer(config, recompute, False, attention)
    if moe:
        per_microbatch += moe * activations_per_layer(config, recompute, True, attention)
    if stage == 0 and m.hidden_dropout:  # embedding dropout mask (none without dropout)
        per_microbatch += s * b * h / (tp if sp else 1)
    in_flight = 1.0
    if pp > 1 and stage < pp - 1:  # 1F1B's warm-up; the interleaved one runs further ahead
        # (stage 0: pp (1 + (pp - 1) / (pp vpp)); only the first and the last stage are
        # weighed unless a pipeline layout makes the stages differ)
        in_flight = pp - stage + (pp - 2 * stage - 1) / vpp if vpp > 1 else pp - stage
        # ... but never more microbatches than the iteration has
        in_flight = min(in_flight, t.global_batch_size // (b * dp) or 1)
    activations = in_flight * per_microbatch
    if pp > 1 and p.pipeline_schedule == "zb-h1":  # stage r defers r microbatches' Ws
        microbatches = t.global_batch_size // (b * dp) or 1
        deferred = min(stage, microbatches - 1)
        activations += deferred * layers * weight_grad_inputs_per_layer(config)
    # the layer being recomputed holds all of its activations
    if recompute in ("full", "op_selective"):
        activations += activations_per_layer(config, "none", moe > 0, attention)
    # Held by one layer at a time, each at its own point of the layer's backward: a MoE layer's
    # all-to-all buffers (its MLP's), and under selective recompute the attention being
    # recomputed over the whole sequence (cp > 1; its core's, after the MLP's): the larger.
    transient = moe_dispatch_bytes(config) if moe else 0.0
    if recompute == "selective":
        transient = max(transient, context_parallel_attention_per_layer(config))
    activations += transient
    # What one layer's attention over the whole sequence holds only while it runs (cp > 1).
    activations += context_parallel_attention_working(config)
    fp32_bytes = 0.0  # held in fp32 whatever the precision
    if stage == pp - 1 and t.fused_linear_cross_entropy:
        # The output layer's input and its gradient, made in the forward (s b h each, whole
        # under sequence parallelism), the weight's fp32 gradient and one chunk's fp32 logits.
        activations += 4 * s * b * h
        fp32_bytes = 4 * v * h / tp + 4 * min(s * b, default_chunk_tokens(v // tp, CUDA)) * v / tp
    elif stage == pp - 1:  # one microbatch reaches the loss at a time
        # BERT's masked LM takes the logits of the predicted tokens only.
        predicted = 1.0 if cfg.causal else MASKED_LM_PROB
        activations += 4 * s * b * h / tp * (1 + v / h) * predicted
    if stage == pp - 1:  # multi-token prediction's depths, one microbatch's
        activations += mtp_activations(config, cfg, recompute, attention)
    if t.cuda_graphs:  # the graphs' static memory besides the activations they keep
        # Each layer's input copy and output, [s, b, h] (/ t under sequence parallelism) each.
        activations += layers * 4 * s * b * h / (tp if sp else 1)
        if not t.gradient_accumulation_fusion:  # the weights' gradients, static too
            activations += layers * layer_parameters_per_rank(cfg, tp) * 2
    if t.precision == "fp32":
        activations *= 2
    activations += fp32_bytes
    copy = checkpoint_copy_bytes_per_parameter(
        t.precision, p.use_distributed_optimizer, dp * cp, sharding
    )
    if experts:  # the experts' optimizer shard is over their data-parallel group
        expert_copy = checkpoint_copy_bytes_per_parameter(
            t.precision, p.use_distributed_optimizer, edp, sharding
        )
        copy = ((params - experts) * copy + experts * expert_copy) / params
    return {
        "parameters": params,
        "expert_parameters": experts,
        **held,
        "weights_and_optimizer": state,
        "activations": activations,
        "total": state + activations,
        # Host memory, not the GPU's: the copy a background save (checkpoint.async_save) keeps.
        "host_checkpoint_copy": params * copy if config.checkpoint.async_save else 0.0,
    }


def mtp_activations(config: Config, cfg, recompute: str, attention: str) -> float:
    """Bytes multi-token prediction's depths (`model.mtp_num_layers`, `models.mtp`) keep on the
    last stage for one microbatch, in `activations_per_layer`'s 16-bit convention: each
    depth's enorm and hnorm inputs (the embedding of the tokens k ahead and the states
    before) and eh_proj's input, their concatenation (2 s b h each, the concatenation twice:
    / t with sequence parallelism); its transformer layer's activations, of its position's
    kind under the model's recompute; and its own logits, as the model's output layer's
    (4 s b h / t (1 + v / h): the final norm's and the output layer's inputs, the fp32
    logits; MTP is refused with the fused loss).  All of them are kept until the backward,
    besides the model's own loss."""
    depths = cfg.mtp_num_layers or 0
    if not depths:
        return 0.0
    t, p = config.training, config.parallel
    tp = p.tensor_model_parallel_size
    s, b, h = t.seq_length // p.context_parallel_size, t.micro_batch_size, cfg.hidden_size
    sp = p.sequence_parallel and tp > 1
    own = 2 * 4 * s * b * h / (tp if sp else 1) + 4 * s * b * h / tp * (1 + cfg.vocab_size / h)
    return sum(
        own + activations_per_layer(config, recompute, is_moe_layer(cfg, i), attention)
        for i in mtp_layer_numbers(cfg)
    )


def weighed_stages(config: Config) -> list[int]:
    """The pipeline stages that can be the fullest: the first (the most microbatches in
    flight, the embedding) and the last (the output layer, the loss, MTP) of an even split;
    under a pipeline layout, whose stages differ in layers, also the first middle stage of
    each (dense, MoE) layer count (a later one holds fewer microbatches in flight)."""
    p = config.parallel
    pp = p.pipeline_model_parallel_size
    if p.pipeline_model_parallel_layout is None or pp <= 2:
        return sorted({0, pp - 1})
    counts = pipeline_layer_counts(config)
    cfg = SimpleNamespace(
        num_layers=config.model.num_layers,
        pipeline_layer_counts=counts,
        num_moe_experts=config.model.num_moe_experts,
        moe_layer_freq=config.model.moe_layer_freq,
    )
    first: dict = {}
    for stage in range(1, pp - 1):
        first.setdefault(stage_layers(cfg, pp, stage), stage)
    return sorted({0, pp - 1, *first.values()})


def estimate_memory_per_gpu(config: Config, recompute: str | None = None, **kwargs) -> float:
    """Bytes per GPU of the fullest pipeline stage (see `memory_breakdown` for the arguments)."""
    return max(
        memory_breakdown(config, recompute, stage=stage, **kwargs)["total"]
        for stage in weighed_stages(config)
    )


def fits(config: Config, gpu_memory_bytes: float, recompute: str | None = None, **kwargs) -> bool:
    """Whether the estimate leaves `HEADROOM` of the GPU free (for what it does not count)."""
    return estimate_memory_per_gpu(config, recompute, **kwargs) <= (1 - HEADROOM) * gpu_memory_bytes


def cheapest_recompute(config: Config, gpu_memory_bytes: float, **kwargs) -> str:
    """The recompute mode that redoes the least work and still fits: none, else selective,
    else full (which is returned even when it does not fit either: nothing recomputes more)."""
    for mode in RECOMPUTE_CHOICES[:-1]:
        if fits(config, gpu_memory_bytes, mode, **kwargs):
            return mode
    return "full"
