"""[parallel]: the layout against the model (tp, pp and virtual stages, the schedule,
sequence and context parallelism), the data-parallel size and the batch, the expert
layout, and the data-parallel sharding.
"""

import functools

from megatrain.config.errors import ConfigError
from megatrain.config.sections import (
    CHOICES,
    DATA_PARALLEL_SHARDINGS,
    PIPELINE_SCHEDULES,
    Config,
)


def pipeline_layer_counts(config: Config) -> tuple[int, ...] | None:
    """The transformer layers of each virtual stage that `parallel.pipeline_model_parallel_layout`
    gives (None without one: the even split).  A malformed layout raises megacore's
    ValueError, which names the field; `validate` turns it into a ConfigError."""
    p = config.parallel
    layout = p.pipeline_model_parallel_layout
    if layout is None:
        return None
    if not isinstance(layout, str):  # Megatron-Bridge's lists, hashable for the cache
        layout = tuple(tuple(stage) for stage in layout)
    return _layer_counts(
        layout,
        p.pipeline_model_parallel_size,
        p.virtual_pipeline_model_parallel_size,
        config.model.num_layers,
        config.model.mtp_num_layers,
    )


@functools.lru_cache(maxsize=256)
def _layer_counts(layout, pp: int, vpp: int | None, layers: int, mtp: int | None) -> tuple:
    """`pipeline_layer_counts`, remembered: `megatrain plan` asks it for every layout."""
    # Imported here: megacore's pipeline package imports torch, and the config stays torch-free.
    from megacore.pipeline_parallel.layer_assignment import parse_pipeline_layout

    name = "parallel.pipeline_model_parallel_layout"
    return tuple(parse_pipeline_layout(layout, pp, vpp, layers, mtp, name=name))


def _check_pipeline_layout(config: Config) -> None:
    """parallel.pipeline_model_parallel_layout against pp x vpp, the layers and the MTP
    depths (megacore's parse_pipeline_layout, which names the field in every refusal)."""
    from megacore.pipeline_parallel.layer_assignment import parse_pipeline_layout

    p = config.parallel
    if not p.pipeline_model_parallel_size > 1:
        raise ConfigError(
            "parallel.pipeline_model_parallel_layout splits the layers over pipeline stages: it "
            "needs parallel.pipeline_model_parallel_size > 1 (it is "
            f"{p.pipeline_model_parallel_size}); unset it"
        )
    layout = p.pipeline_model_parallel_layout
    try:
        if isinstance(layout, str):  # remembered: `megatrain plan` checks thousands of them
            pipeline_layer_counts(config)
        else:  # Megatron-Bridge's lists, refused as they were written
            parse_pipeline_layout(
                layout,
                p.pipeline_model_parallel_size,
                p.virtual_pipeline_model_parallel_size,
                config.model.num_layers,
                config.model.mtp_num_layers,
                name="parallel.pipeline_model_parallel_layout",
            )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_layout(config: Config) -> None:
    """The model's shape against tp, pp (and virtual stages), the schedule, the sequence,
    sequence parallelism and context parallelism."""
    m, p, t = config.model, config.parallel, config.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    vpp = p.virtual_pipeline_model_parallel_size
    if m.hidden_size % m.num_attention_heads != 0:
        raise ConfigError(
            f"model.hidden_size ({m.hidden_size}) is not divisible by model.num_attention_heads "
            f"({m.num_attention_heads})"
        )
    if m.num_attention_heads % tp != 0:
        raise ConfigError(
            f"model.num_attention_heads ({m.num_attention_heads}) is not divisible by "
            f"parallel.tensor_model_parallel_size ({tp})"
        )
    if m.num_query_groups is not None:  # unset: a key/value head per head, split as the heads
        groups = m.num_query_groups
        if m.num_attention_heads % groups != 0:
            raise ConfigError(
                f"model.num_attention_heads ({m.num_attention_heads}) is not divisible by "
                f"model.num_query_groups ({groups})"
            )
        if groups % tp != 0 and tp % groups != 0:
            raise ConfigError(
                f"model.num_query_groups ({groups}) and parallel.tensor_model_parallel_size "
                f"({tp}): one must divide the other (each TP rank holds whole key/value groups; "
                "with fewer groups than TP ranks each group is replicated on tp / groups ranks)"
            )
    if config.ffn_hidden_size % tp != 0:
        raise ConfigError(
            f"model.ffn_hidden_size ({config.ffn_hidden_size}) is not divisible by "
            f"parallel.tensor_model_parallel_size ({tp})"
        )
    if vpp is not None and vpp > 1 and not pp > 1:
        raise ConfigError(
            f"parallel.virtual_pipeline_model_parallel_size ({vpp}) needs "
            f"parallel.pipeline_model_parallel_size > 1, got {pp}"
        )
    _check_schedule(config)
    chunks = pp * (vpp or 1)
    if p.pipeline_model_parallel_layout is None:
        if m.num_layers % chunks != 0:
            raise ConfigError(
                f"model.num_layers ({m.num_layers}) is not divisible by "
                f"parallel.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size "
                f"({pp} x {vpp or 1} = {chunks}); change them, or give each virtual stage its "
                "layers in parallel.pipeline_model_parallel_layout"
            )
    else:
        _check_pipeline_layout(config)
    if not t.seq_length <= m.max_position_embeddings:
        raise ConfigError(
            f"training.seq_length ({t.seq_length}) is above model.max_position_embeddings "
            f"({m.max_position_embeddings}), the size of the position table"
        )
    if p.sequence_parallel and t.seq_length % tp != 0:
        raise ConfigError(
            f"parallel.sequence_parallel needs training.seq_length ({t.seq_length}) divisible "
            f"by parallel.tensor_model_parallel_size ({tp})"
        )
    if p.tp_comm_overlap and not (tp > 1 and p.sequence_parallel):
        raise ConfigError(
            "parallel.tp_comm_overlap = true overlaps sequence parallelism's all-gathers and "
            "reduce-scatters with the GEMMs: it needs parallel.tensor_model_parallel_size > 1 "
            f"(it is {tp}) and parallel.sequence_parallel = true (it is "
            f"{str(p.sequence_parallel).lower()}); set them, or parallel.tp_comm_overlap = false"
        )
    if not p.use_distributed_optimizer and p.overlap_param_gather:
        raise ConfigError(
            "parallel.overlap_param_gather overlaps the distributed optimizer's parameter "
            "all-gather: it needs parallel.use_distributed_optimizer = true"
        )
    if p.sequence_parallel and p.distribute_saved_activations and tp > 1:
        raise ConfigError(
            "parallel.distribute_saved_activations keeps 1/tp of each layer's input, which must be "
            "the same on every TP rank; under parallel.sequence_parallel it is already split: "
            "turn one of them off"
        )
    _check_context_parallel(config)


def _check_schedule(config: "Config") -> None:
    """parallel.pipeline_schedule against the layout and the features a split backward
    (zb-h1) cannot serve."""
    p = config.parallel
    schedule, vpp = p.pipeline_schedule, p.virtual_pipeline_model_parallel_size or 1
    if schedule is None:
        return
    if schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(
            f"parallel.pipeline_schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}"
        )
    if (schedule == "interleaved") != (vpp > 1):
        raise ConfigError(
            f"parallel.pipeline_schedule = {schedule!r} with "
            f"parallel.virtual_pipeline_model_parallel_size = {vpp}: the interleaved schedule is "
            "the one for virtual stages (size > 1), and only it"
            + ("; set the virtual size or another schedule" if schedule == "interleaved" else "")
        )
    if schedule == "zb-h1":
        if not p.pipeline_model_parallel_size > 1:
            raise ConfigError(
                "parallel.pipeline_schedule = 'zb-h1' needs pipeline stages: "
                f"parallel.pipeline_model_parallel_size is {p.pipeline_model_parallel_size}"
            )
        if config.training.compile:
            raise ConfigError(
                "parallel.pipeline_schedule = 'zb-h1' with training.compile = true: a compiled "
                "layer's backward is traced once, so its weight gradients cannot be deferred to "
                "the W step; turn one of them off"
            )


def _check_context_parallel(config: Config) -> None:
    """What a sequence split over CP ranks needs: 2 x cp equal chunks, causal attention
    without dropout, per-token work elsewhere."""
    m, p, t = config.model, config.parallel, config.training
    cp = p.context_parallel_size
    if p.cp_comm_type not in CHOICES[("parallel", "cp_comm_type")]:
        raise ConfigError(
            f"parallel.cp_comm_type must be one of {CHOICES[('parallel', 'cp_comm_type')]}, got "
            f"{p.cp_comm_type!r}"
        )
    if p.cp_comm_type == "latent" and not m.multi_latent_attention:
        raise ConfigError(
            "parallel.cp_comm_type = 'latent' gathers multi-latent attention's compressed KV "
            "latent: needs model.multi_latent_attention = true (else 'p2p' or 'allgather')"
        )
    if cp == 1:
        return
    why = f"parallel.context_parallel_size = {cp}"
    if t.seq_length % (2 * cp) != 0:
        raise ConfigError(
            f"{why} cuts each sequence into 2 x cp = {2 * cp} equal chunks: training.seq_length "
            f"({t.seq_length}) is not divisible by {2 * cp}"
        )
    tp = p.tensor_model_parallel_size
    if p.sequence_parallel and t.seq_length // cp % tp != 0:
        raise ConfigError(
            f"{why} with parallel.sequence_parallel: each CP rank's {t.seq_length // cp} tokens "
            f"must divide over parallel.tensor_model_parallel_size ({tp})"
        )
    if m.kind == "bert":
        raise ConfigError(
            f"{why} with model.kind = 'bert': context parallelism here is for causal attention "
            "(GPT, Llama); BERT's sequences (512 tokens) fit one rank"
        )
    if m.attention_dropout:
        raise ConfigError(
            f"{why} with model.attention_dropout = {m.attention_dropout}: the attention over CP "
            "ranks has no dropout (Llama trains without); set model.attention_dropout = 0"
        )
    if t.cuda_graphs:
        raise ConfigError(
            f"{why} with training.cuda_graphs = true: the attention's communication with the "
            "other CP ranks is not captured; turn one off"
        )


def _data_parallel_size(config: Config, world_size: int | None) -> int:
    """The data-parallel size the job's processes leave (or the config's own), checked
    against the config's data_parallel_size and the batch sizes."""
    p, t = config.parallel, config.training
    tp, pp, cp = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.context_parallel_size,
    )
    vpp = p.virtual_pipeline_model_parallel_size
    if world_size is None:
        dp = p.data_parallel_size or 1
    else:
        sizes = (
            f"tensor_model_parallel_size x context_parallel_size x pipeline_model_parallel_size "
            f"({tp} x {cp} x {pp})"
            if cp > 1
            else f"tensor_model_parallel_size x pipeline_model_parallel_size ({tp} x {pp})"
        )
        if world_size % (tp * cp * pp) != 0:
            raise ConfigError(
                f"the job has {world_size} processes, not divisible by parallel.{sizes}"
            )
        dp = world_size // (tp * cp * pp)
        layout = f"tp {tp} x cp {cp} x pp {pp}" if cp > 1 else f"tp {tp} x pp {pp}"
        if p.data_parallel_size not in (None, dp):
            raise ConfigError(
                f"parallel.data_parallel_size is {p.data_parallel_size}, but the job has "
                f"{world_size} processes = {layout} x dp {dp}"
            )
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step != 0:
        raise ConfigError(
            f"training.global_batch_size ({t.global_batch_size}) is not divisible by "
            f"training.micro_batch_size x data-parallel size ({t.micro_batch_size} x {dp} = "
            f"{per_step})"
        )
    if vpp is not None and vpp > 1:
        microbatches = t.global_batch_size // per_step
        if microbatches % pp != 0:
            raise ConfigError(
                f"the interleaved schedule needs the number of microbatches (global_batch_size / "
                f"(micro_batch_size x dp) = {microbatches}) to be a multiple of "
                f"parallel.pipeline_model_parallel_size ({pp})"
            )
    return dp


def _check_expert_parallel(config: Config, world_size: int | None) -> None:
    """The expert layout (parallel.expert_model_parallel_size, expert_tensor_parallel_size)
    against the model, the dense layout and the job's processes."""
    m, p = config.model, config.parallel
    ep, tp, pp = (
        p.expert_model_parallel_size,
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
    )
    etp = tp if p.expert_tensor_parallel_size is None else p.expert_tensor_parallel_size
    E = m.num_moe_experts
    if E is None:
        if ep != 1 or p.expert_tensor_parallel_size is not None:
            raise ConfigError(
                "parallel.expert_model_parallel_size / expert_tensor_parallel_size split the "
                "experts of a mixture of experts: set model.num_moe_experts, or leave them unset"
            )
        return
    if E % ep != 0:
        raise ConfigError(
            f"model.num_moe_experts ({E}) is not divisible by parallel.expert_model_parallel_size "
            f"({ep}): each expert-parallel rank holds the same number of experts"
        )
    f = m.moe_ffn_hidden_size or config.ffn_hidden_size
    name = "model.moe_ffn_hidden_size" if m.moe_ffn_hidden_size else "model.ffn_hidden_size"
    if f % etp != 0:
        raise ConfigError(
            f"{name} ({f}, each expert's) is not divisible by the expert tensor-parallel size "
            f"({etp}, parallel.expert_tensor_parallel_size or else tensor_model_parallel_size)"
        )
    groups = m.moe_router_num_groups
    if m.moe_group_limited_dispatch and ep != 1 and groups % ep != 0:
        raise ConfigError(
            f"model.moe_group_limited_dispatch = true needs whole routing groups on each "
            f"expert-parallel rank: model.moe_router_num_groups ({groups}) must be a multiple of "
            f"parallel.expert_model_parallel_size ({ep})"
        )
    if etp != 1 and config.model_switch("add_bias_linear") and m.hidden_size % etp != 0:
        raise ConfigError(
            f"model.hidden_size ({m.hidden_size}) is not divisible by the expert "
            f"tensor-parallel size ({etp}) with model.add_bias_linear = true: each rank holds "
            "its share of the experts' fc2 bias, by h's columns"
        )
    if tp != 1 and not p.sequence_parallel:
        raise ConfigError(
            f"model.num_moe_experts with parallel.tensor_model_parallel_size = {tp} needs "
            "parallel.sequence_parallel = true (Megatron's rule): without it every TP rank holds "
            "the same tokens, and the experts, reached from every TP rank, would take each token "
            f"{tp} times"
        )
    if world_size is not None and world_size % (etp * ep * pp) != 0:
        raise ConfigError(
            f"the job has {world_size} processes, not divisible by the expert layout "
            f"parallel.expert_tensor_parallel_size x expert_model_parallel_size x "
            f"pipeline_model_parallel_size ({etp} x {ep} x {pp} = {etp * ep * pp})"
        )


def _check_data_parallel_sharding(config: Config) -> None:
    """parallel.data_parallel_sharding: "optimizer" and use_distributed_optimizer are one
    switch (each sets the other here); "full" (torch's FSDP2) refuses what it cannot serve
    yet, naming what to use instead."""
    p, t = config.parallel, config.training
    sharding = p.data_parallel_sharding
    if sharding not in DATA_PARALLEL_SHARDINGS:
        raise ConfigError(
            f"parallel.data_parallel_sharding must be one of {DATA_PARALLEL_SHARDINGS}, got "
            f"{sharding!r}"
        )
    if sharding != "full":
        if p.reshard_after_forward is not None:
            raise ConfigError(
                "parallel.reshard_after_forward is for parallel.data_parallel_sharding = 'full' "
                f"(FSDP), not {sharding!r}: leave it unset"
            )
        if p.reduce_every_microbatch:
            raise ConfigError(
                "parallel.reduce_every_microbatch is for parallel.data_parallel_sharding = 'full' "
                f"(FSDP), not {sharding!r}: megacore's DDP accumulates into its fp32 buffer, "
                "which holds every gradient anyway; leave it false"
            )
        if p.use_distributed_optimizer or sharding == "optimizer":
            p.use_distributed_optimizer, p.data_parallel_sharding = True, "optimizer"
        return
    why = "parallel.data_parallel_sharding = 'full'"
    if p.use_distributed_optimizer:
        raise ConfigError(
            f"{why} with parallel.use_distributed_optimizer = true: that is the 'optimizer' "
            "sharding (ZeRO-1); 'full' shards the optimizer state already: drop "
            "use_distributed_optimizer"
        )
    if p.reshard_after_forward and p.pipeline_model_parallel_size > 1:
        raise ConfigError(
            f"{why} with parallel.reshard_after_forward = true at pipeline_model_parallel_size "
            f"{p.pipeline_model_parallel_size}: a pipeline schedule runs a layer's forward and "
            "backward for several microbatches in turn, and would gather its parameters again "
            "for each; leave parallel.reshard_after_forward unset (off under pipelining)"
        )
    refusals = [
        (
            t.cuda_graphs,
            "training.cuda_graphs = true: FSDP's parameter all-gathers and gradient "
            "reduce-scatters run from Python hooks, which a replayed graph does not run; set "
            "training.cuda_graphs = false, or use data_parallel_sharding = 'optimizer'",
        ),
        (
            t.precision == "fp16",
            "training.precision = 'fp16': the loss scaler's inf/nan check over FSDP's sharded "
            "gradients is not built; use training.precision = 'bf16' (no loss scale), or "
            "data_parallel_sharding = 'optimizer' for fp16",
        ),
        (
            p.pipeline_schedule == "zb-h1",
            "parallel.pipeline_schedule = 'zb-h1': FSDP reduce-scatters a layer's gradients "
            "when its backward ends, before ZB-H1's deferred weight-gradient (W) steps run; use "
            "pipeline_schedule = '1f1b' (or 'interleaved'), or data_parallel_sharding = "
            "'optimizer' with zb-h1",
        ),
        (
            t.gradient_accumulation_fusion,
            "training.gradient_accumulation_fusion = true: the fused GEMMs add into megacore "
            "DDP's main_grad buffer, which FSDP's sharded gradients replace; set "
            "training.gradient_accumulation_fusion = false",
        ),
        (
            p.overlap_param_gather,
            "parallel.overlap_param_gather = true: that overlaps the distributed optimizer's "
            "all-gather; FSDP prefetches each layer's parameters itself: drop it",
        ),
    ]
    for refused, message in refusals:
        if refused:
            raise ConfigError(f"{why} with {message}")
