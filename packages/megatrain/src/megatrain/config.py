"""Run configuration: TOML sections as dataclasses, overrides, and checks before any worker starts.

A config file (`pipelines/models/<name>.toml`) has the sections below; every
field has Megatron-LM's name (snake case).  `section.field=value` on the
command line overrides a field (the value is read as TOML, so `3e-4`, `true`
and `"bf16"` keep their types).  An unknown section or field, a value of the
wrong type, or a layout the model cannot be split into is refused here, with
the field and the numbers, so no worker starts on a config that would fail later.
"""

import dataclasses
import functools
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# megacore.pipeline_parallel.SCHEDULES, named here so reading a config needs no torch (a
# test holds the two equal).
PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1")
DATA_PARALLEL_SHARDINGS = ("none", "optimizer", "full")


class ConfigError(ValueError):
    """A config file or override that cannot run; the message names the field and what is wrong."""


# Activation recompute modes, the cheapest in compute first.
RECOMPUTE_CHOICES = ("none", "selective", "full")
MODEL_KINDS = ("gpt", "bert", "llama")
# The kinds that are causal language models (trained and scored token by token).
CAUSAL_KINDS = ("gpt", "llama")
BLOCK_ORDERS = ("pre_ln", "post_ln")
NORMALIZATIONS = ("layernorm", "rmsnorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
# megacore.moe's choices, named here so reading a config needs no torch (a test holds them
# equal).
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
MOE_DROP_POLICIES = ("probs", "position")
MOE_TOKEN_DISPATCHER_TYPES = ("alltoall", "allgather")


@dataclass(kw_only=True)
class MoEConfig:
    """The mixture-of-experts switches (megatrain.models.moe; Megatron-LM's names), fields of
    both [model] (`ModelConfig`) and the transformer (`TransformerConfig`).  Keyword-only, so
    they can follow any class's positional fields."""

    num_moe_experts: int | None = None  # None: a dense model
    moe_router_topk: int = 2  # experts per token
    moe_ffn_hidden_size: int | None = None  # each expert's; None: ffn_hidden_size
    # A shared expert every token goes through (Qwen2-MoE, DeepSeek), of this size; None: none.
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False  # its output x sigmoid(a [1, h] linear) (Qwen2-MoE)
    moe_router_score_function: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    # Softmax over all experts before the top k (HF Mixtral/Qwen order) instead of over the
    # chosen k's logits (Megatron's default; the same weights as Mixtral's).
    moe_router_pre_softmax: bool = False
    # With pre_softmax: the k weights divided by their sum (HF's norm_topk_prob; Qwen3-MoE
    # true, Qwen2-MoE false).  Sigmoid scores are always normalized (k > 1).
    moe_router_norm_topk_prob: bool = False
    moe_router_topk_scaling_factor: float | None = None  # the weights times this
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | none
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    # DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the sigmoid
    # scores to choose (never to the weights), moved by moe_router_bias_update_rate per step
    # towards equal loads.
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    # Each expert takes at most ceil(tokens x topk / experts x factor) choices, dropping the
    # rest by moe_token_drop_policy ("probs": the lowest weights; "position": the latest
    # tokens); None: dropless.
    moe_expert_capacity_factor: float | None = None
    moe_token_drop_policy: str = "probs"
    # Which layers are MoE: every Nth (layer i when i % N == 0), or a 0/1 per layer.
    moe_layer_freq: int | list = 1
    # The experts' GEMMs as torch's grouped GEMM where the torch in use has it for the device
    # and dtype (else a loop over the experts, the same numbers); false: always the loop.
    moe_grouped_gemm: bool = True
    # How tokens reach experts on other ranks (parallel.expert_model_parallel_size > 1, or
    # experts split over expert_tensor_parallel_size): "alltoall" (each token to its experts'
    # ranks) or "allgather" (every token to every rank of ETP x EP); Megatron's names.
    moe_token_dispatcher_type: str = "alltoall"


MOE_FIELDS = tuple(f.name for f in dataclasses.fields(MoEConfig))
# What each kind takes where its [model] section leaves a switch unset (None): normalization,
# position_embedding_type, swiglu, add_bias_linear, untie_embeddings_and_output_weights.
# The [model] switches that make a Llama of the same transformer, in KIND_DEFAULTS' order.
MODEL_SWITCHES = ("normalization", "position_embedding_type", "swiglu", "add_bias_linear",
                  "untie_embeddings_and_output_weights")  # fmt: skip
KIND_DEFAULTS = {
    "gpt": ("layernorm", "learned_absolute", False, True, False),
    "bert": ("layernorm", "learned_absolute", False, True, False),
    "llama": ("rmsnorm", "rope", True, False, True),
}


@dataclass
class ModelConfig(MoEConfig):
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # 4 x hidden_size when not given
    max_position_embeddings: int = 1024
    # The tokenizer's vocabulary; the embedding is padded to a multiple of
    # make_vocab_size_divisible_by x tp.  0 = take it from the corpus manifest.
    vocab_size: int = 0
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    # "full": recompute each layer in backward (the paper); "selective": only the
    # attention core (softmax and dropout); "none".
    recompute: str = "none"
    # "gpt": causal language model; "bert": masked LM + sentence-order prediction.
    kind: str = "gpt"
    # "pre_ln": LayerNorm on the input of attention and MLP, and a final one (GPT-2; BERT as
    # the paper reorders it, Fig. 7 b); "post_ln": after each residual add (BERT's original, a).
    block_order: str = "pre_ln"
    # The switches that make a Llama of the same transformer; None: the kind's (KIND_DEFAULTS).
    normalization: str | None = None  # layernorm | rmsnorm
    position_embedding_type: str | None = None  # learned_absolute | rope
    swiglu: bool | None = None  # SwiGLU MLP (gate and up projections of ffn_hidden_size)
    add_bias_linear: bool | None = None  # biases in the attention and MLP linears
    untie_embeddings_and_output_weights: bool | None = None
    # Grouped-query attention: heads share this many key/value heads (None: one per head;
    # 1: multi-query attention).  Split over TP: divisible by tensor_model_parallel_size.
    num_query_groups: int | None = None
    # Each head's width (Megatron's kv_channels); None: hidden_size / num_attention_heads.
    # Qwen3 has heads of 128 at hidden 2048 and 32 heads: the projection's input is
    # num_attention_heads x kv_channels.
    kv_channels: int | None = None
    # RMSNorm (or LayerNorm, as model.normalization) over each head's kv_channels applied to
    # the queries and keys before the rotary embedding (Qwen3's q_norm and k_norm).
    qk_layernorm: bool = False
    # Biases on the query, key and value projections alone (Qwen2) while add_bias_linear is
    # false; split over TP with the projection's columns.
    add_qkv_bias: bool = False
    rotary_base: float = 10000.0  # HF's rope_theta
    # Llama 3.1's frequency scaling of the rotary embeddings (HF rope_scaling type "llama3");
    # factor 0 = off.
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    # "1f1b", "interleaved" (the one with virtual stages) or "zb-h1" (backwards split into
    # input and weight gradients, the weight gradients filling the bubble); None = the
    # layout's: interleaved with virtual stages, else 1f1b.
    pipeline_schedule: str | None = None
    # None = whatever the world gives: world size / (tp x cp x pp).
    data_parallel_size: int | None = None
    # Context parallelism: each sequence split over this many ranks (2 x cp chunks, rank r
    # holding chunks r and 2cp-1-r), megatron-core's order tp-cp-dp-pp.  Attention by
    # cp_comm_type: "p2p" (a ring passing K/V blocks, overlapped) or "allgather" (Llama 3's).
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"
    sequence_parallel: bool = False
    # Megatron-LM's --tp-comm-overlap: under sequence parallelism each column-parallel
    # linear's all-gather and each row-parallel linear's reduce-scatter run as rings of
    # tp - 1 point-to-point steps overlapped with partial GEMMs (megacore's
    # tensor_parallel.comm_overlap); needs tensor_model_parallel_size > 1 and sequence_parallel.
    tp_comm_overlap: bool = False
    # Mixture of experts (model.num_moe_experts): the experts split over this many ranks, and
    # each expert's fc1/fc2 over expert_tensor_parallel_size (None: tensor_model_parallel_size),
    # a layout of their own over the same world and pipeline stages (megatron-core's
    # "parallel folding"): expert data-parallel size = world / (etp x ep x pp).
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    # What data parallelism shards (issue 47): "none" (every DP rank holds the whole model
    # piece and its optimizer state), "optimizer" (ZeRO-1, Megatron's distributed optimizer;
    # `use_distributed_optimizer = true` is its alias) or "full" (ZeRO-3: parameters,
    # gradients and optimizer state, through torch's FSDP2 `fully_shard` per transformer layer
    # and per chunk, over the DP x CP group).
    data_parallel_sharding: str = "none"
    # "full" only: free each layer's gathered parameters after its forward (ZeRO-3) or keep
    # them until its backward (ZeRO-2 in memory); None = the layout's (off under pipeline
    # parallelism, as torchtitan, where microbatches' forwards and backwards interleave).
    reshard_after_forward: bool | None = None
    # "full" only: reduce-scatter every microbatch's gradients into the shards (torchtitan's
    # and Composer's way: one layer's unsharded gradient at a time) instead of accumulating
    # every parameter's unsharded fp32 gradient over the step's microbatches and reducing
    # once, after the last (the default: one reduce-scatter a step, 4 bytes a parameter more).
    reduce_every_microbatch: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = True
    # Leave the distributed optimizer's parameter all-gather running into the next forward.
    overlap_param_gather: bool = False
    bucket_size: int = 40_000_000  # elements per DDP gradient bucket
    # Keep activations between layers sharded over TP under full recompute.
    distribute_saved_activations: bool = False
    # Seconds a rank waits in one collective for the others before the job stops, naming
    # the rank, the operation and the peers that did not arrive (a hung or lost rank).
    collective_timeout: int = 600


@dataclass
class OptimizerSection:
    lr: float = 1.5e-4
    min_lr: float = 1e-5
    lr_decay_style: str = "cosine"  # cosine | linear | constant
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # None = train_iters
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    loss_scale: float | None = None  # fp16: a constant scale; None = dynamic
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


@dataclass
class TrainingConfig:
    seq_length: int = 1024
    micro_batch_size: int = 1
    global_batch_size: int = 8
    train_iters: int = 100
    # fp32 | bf16 | fp16 | fp8 (bf16 with the layers' GEMMs in float8 through torchao's float8
    # training: an H100-class GPU and torchao, `megatrain[gpu]`).
    precision: str = "fp32"
    # fp8 through torchao's emulation: the float8 casts and scales, the matmuls in high
    # precision; any device, for checking the numbers without the speed.
    fp8_emulate: bool = False
    # torch.compile each transformer layer (fuses bias + GeLU and bias + dropout + residual);
    # the same numbers as without, after a compile of a few seconds to minutes at start.
    compile: bool = False
    # GPT and Llama: the output layer and its cross entropy as one chunked op that never holds
    # the [tokens, vocab] fp32 logits and makes the output layer's gradients in the forward
    # (held until backward: [tokens, h] and [vocab / tp, h] fp32); the same numbers.  Not
    # with fp16 (the gradients would be rounded before loss scaling).
    fused_linear_cross_entropy: bool = False
    # The linears' weight-gradient GEMMs add straight into the data-parallel gradient buffer
    # (main_grad) instead of making param.grad and adding it (Megatron-LM's flag).
    gradient_accumulation_fusion: bool = False
    # Read the device once an iteration (the loss, the gradient norm and inf/nan flag, the
    # stop agreement together) instead of three times; the optimizer then runs torch's fused
    # AdamW, which skips a step on the device.  A signal is acted on one iteration later
    # when it arrives during logging or evaluation.
    one_sync_per_iteration: bool = False
    # Each transformer layer's forward and backward as CUDA graphs (torch.cuda.
    # make_graphed_callables: one launch a layer and pass instead of one per kernel), for a
    # one-stage layout with static shapes; the layers' graphs hold one microbatch's
    # activations for good.  CUDA only.
    cuda_graphs: bool = False
    seed: int = 1234
    eval_interval: int = 100
    eval_iters: int = 10
    # Stop with an error after this many iterations in a row with a non-finite loss.
    max_nonfinite_losses: int = 10
    # Save and stop at the first iteration that is a multiple of it (a job's time slice).
    exit_interval: int | None = None
    # Where logs, TensorBoard events and the loss plot go; relative to the working directory.
    output_dir: str = "runs/default"


DEFAULT_CORPUS = "data/corpus/default"  # what a run reads when data names no corpus
PACKING_SWITCHES = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")


@dataclass
class DataConfig:
    # One corpus directory (unset: DEFAULT_CORPUS, unless `blend` is set).
    corpus: str | None = None
    # A weighted blend in place of `corpus`: [[weight, directory], ...], the weights
    # normalised (Megatron-LM's --data-path 0.3 wiki 0.7 web); megatrain.data.blend.
    blend: list | None = None
    # The valid split's blend, when it is not `blend`'s (or `corpus`'s) valid split.
    valid_blend: list | None = None
    # Packed documents (Megatron-LM's switches; GPT and Llama): positions restart after each
    # end-of-document token, attention never crosses one, no loss where the input is one.
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    # Check every shard against its manifest sha256 before training (once per run: in
    # `megatrain run` before the workers start, or on each node's local rank 0 under
    # torchrun/Slurm), so a corrupted or half-copied shard stops the run at the start.
    verify_sha256: bool = True
    # Pin the tokenizer: the corpus manifest's tokenizer sha256 must equal it.
    tokenizer_sha256: str | None = None
    # BERT samples: the fraction of tokens predicted, the longest whole-word n-gram masked,
    # and how often a sample is cut shorter than seq_length (Megatron's short_seq_prob).
    masked_lm_prob: float = 0.15
    max_ngram: int = 3
    short_seq_prob: float = 0.1


@dataclass
class CheckpointConfig:
    save: str | None = None  # directory; None = no checkpoints
    # Resume from this directory's `latest`.  Equal to `save`, a directory without a
    # checkpoint yet starts from iteration 0 (so one command starts and resumes a run).
    load: str | None = None
    save_interval: int | None = None  # iterations; None = at the end and on SIGTERM/SIGINT only
    keep: int = 0  # newest iterations kept; 0 = all
    # Write each save in the background (megatrain.checkpoint.background): training stalls
    # only for a copy of the rank's state to host memory (one more copy held there).
    async_save: bool = False
    # Seconds a stop by SIGINT/SIGTERM waits for a background write before abandoning it
    # (`latest` then names the previous checkpoint); the end of training waits for it fully.
    async_save_timeout: float = 300.0


@dataclass
class LoggingConfig:
    log_interval: int = 10
    tensorboard: bool = True
    # Peak dense TFLOP/s of one device for MFU; None = from megatrain.run.metrics' table
    # (GPUs) or a measured matrix multiply (CPUs).
    peak_tflops: float | None = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    name: str = "default"  # the config file's stem

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Config":
        sections = {k: _SECTION_TYPES[k](**v) for k, v in data.items() if k in _SECTION_TYPES}
        return cls(**sections, name=data.get("name", "default"))

    @property
    def ffn_hidden_size(self) -> int:
        return self.model.ffn_hidden_size or 4 * self.model.hidden_size

    def model_switch(self, name: str):
        """A [model] switch as the run takes it: its value, or the kind's default when unset."""
        value = getattr(self.model, name)
        if value is not None:
            return value
        return KIND_DEFAULTS[self.model.kind][MODEL_SWITCHES.index(name)]

    @property
    def model_parallel_size(self) -> int:
        return self.parallel.tensor_model_parallel_size * self.parallel.pipeline_model_parallel_size

    @property
    def ranks_per_replica(self) -> int:
        """Ranks holding one data-parallel replica: tp x cp x pp."""
        return self.model_parallel_size * self.parallel.context_parallel_size


_SECTION_TYPES = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerSection,
    "training": TrainingConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}
CHOICES = {
    ("model", "recompute"): RECOMPUTE_CHOICES,
    ("optimizer", "lr_decay_style"): ("cosine", "linear", "constant"),
    ("training", "precision"): ("fp32", "bf16", "fp16", "fp8"),
    ("parallel", "cp_comm_type"): ("p2p", "allgather"),
    ("parallel", "data_parallel_sharding"): DATA_PARALLEL_SHARDINGS,
    ("model", "moe_router_score_function"): MOE_SCORE_FUNCTIONS,
    ("model", "moe_router_load_balancing_type"): MOE_LOAD_BALANCING_TYPES,
    ("model", "moe_token_drop_policy"): MOE_DROP_POLICIES,
    ("model", "moe_token_dispatcher_type"): MOE_TOKEN_DISPATCHER_TYPES,
}


def _type_name(annotation) -> str:
    return " or ".join(
        getattr(k, "__name__", str(k)) for k in typing.get_args(annotation) or [annotation]
    )


def _coerce(where: str, value, default, annotation):
    """Check a TOML value against a field's type; ints are accepted for floats."""
    kinds = typing.get_args(annotation) or (annotation,)
    # TOML has no null: "none" clears a field that may be None (and is not a string field).
    spelled_none = isinstance(value, str) and value.lower() in ("none", "null") and str not in kinds
    if value is None or spelled_none:
        if type(None) in kinds:
            return None
        raise ConfigError(f"{where}: a value is required (default {default!r})")
    for want in kinds:
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, want) and not (want is int and isinstance(value, bool)):
            return value
    raise ConfigError(
        f"{where}: expected {_type_name(annotation)}, got {value!r} ({type(value).__name__})"
    )


def _apply(config: Config, section: str, key: str, value, source: str) -> None:
    if section not in _SECTION_TYPES:
        raise ConfigError(
            f"{source}: unknown section [{section}]; known: {', '.join(_SECTION_TYPES)}"
        )
    fields = {f.name: f for f in dataclasses.fields(_SECTION_TYPES[section])}
    if key not in fields:
        raise ConfigError(
            f"{source}: unknown field {section}.{key}; [{section}] has: {', '.join(fields)}"
        )
    where = f"{source}: {section}.{key}"
    f = fields[key]
    value = _coerce(where, value, f.default, f.type)
    choices = CHOICES.get((section, key))
    if choices and value not in choices:
        raise ConfigError(f"{where}: expected one of {', '.join(choices)}, got {value!r}")
    setattr(getattr(config, section), key, value)


def _parse_override(text: str):
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(
            f"override {text!r}: expected section.field=value, e.g. training.train_iters=100"
        )
    name, raw = text.split("=", 1)
    section, key = name.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string such as bf16 or a path
    return section, key, value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a config file (or start from the defaults) and apply `section.field=value` overrides."""
    config = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist (see pipelines/models/)")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: not valid TOML: {e}") from e
        config.name = path.stem
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(
                    f"{path}: top-level key {section!r} must be a [section] of fields"
                )
            for key, value in values.items():
                _apply(config, section, key, value, str(path))
    for text in overrides:
        section, key, value = _parse_override(text)
        _apply(config, section, key, value, f"override {text!r}")
    return config


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_schedule(config: "Config") -> None:
    """parallel.pipeline_schedule against the layout and the features a split backward
    (zb-h1) cannot serve."""
    p = config.parallel
    schedule, vpp = p.pipeline_schedule, p.virtual_pipeline_model_parallel_size or 1
    if schedule is None:
        return
    _need(
        schedule in PIPELINE_SCHEDULES,
        f"parallel.pipeline_schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}",
    )
    _need(
        (schedule == "interleaved") == (vpp > 1),
        f"parallel.pipeline_schedule = {schedule!r} with "
        f"parallel.virtual_pipeline_model_parallel_size = {vpp}: the interleaved schedule is "
        "the one for virtual stages (size > 1), and only it"
        + ("; set the virtual size or another schedule" if schedule == "interleaved" else ""),
    )
    if schedule == "zb-h1":
        _need(
            p.pipeline_model_parallel_size > 1,
            "parallel.pipeline_schedule = 'zb-h1' needs pipeline stages: "
            f"parallel.pipeline_model_parallel_size is {p.pipeline_model_parallel_size}",
        )
        _need(
            not config.training.compile,
            "parallel.pipeline_schedule = 'zb-h1' with training.compile = true: a compiled "
            "layer's backward is traced once, so its weight gradients cannot be deferred to "
            "the W step; turn one of them off",
        )


def _check_context_parallel(config: Config) -> None:
    """What a sequence split over CP ranks needs: 2 x cp equal chunks, causal attention
    without dropout, per-token work elsewhere."""
    m, p, t = config.model, config.parallel, config.training
    cp = p.context_parallel_size
    _need(
        p.cp_comm_type in CHOICES[("parallel", "cp_comm_type")],
        f"parallel.cp_comm_type must be one of {CHOICES[('parallel', 'cp_comm_type')]}, got "
        f"{p.cp_comm_type!r}",
    )
    if cp == 1:
        return
    why = f"parallel.context_parallel_size = {cp}"
    _need(
        t.seq_length % (2 * cp) == 0,
        f"{why} cuts each sequence into 2 x cp = {2 * cp} equal chunks: training.seq_length "
        f"({t.seq_length}) is not divisible by {2 * cp}",
    )
    tp = p.tensor_model_parallel_size
    _need(
        not p.sequence_parallel or (t.seq_length // cp) % tp == 0,
        f"{why} with parallel.sequence_parallel: each CP rank's {t.seq_length // cp} tokens "
        f"must divide over parallel.tensor_model_parallel_size ({tp})",
    )
    _need(
        m.kind != "bert",
        f"{why} with model.kind = 'bert': context parallelism here is for causal attention "
        "(GPT, Llama); BERT's sequences (512 tokens) fit one rank",
    )
    _need(
        not m.attention_dropout,
        f"{why} with model.attention_dropout = {m.attention_dropout}: the attention over CP "
        "ranks has no dropout (Llama trains without); set model.attention_dropout = 0",
    )
    _need(
        not t.cuda_graphs,
        f"{why} with training.cuda_graphs = true: the attention's communication with the "
        "other CP ranks is not captured; turn one off",
    )


def _check_data(config: Config) -> None:
    """The blends' shape and weights (the corpora themselves are opened by preflight)."""
    from megatrain.data.blend import check_blend

    d = config.data
    _need(
        d.blend is None or d.corpus is None,
        f"data.blend and data.corpus are both set (corpus {d.corpus!r}); a blend names all "
        "the corpora a run reads: add the corpus to data.blend, or drop data.blend",
    )
    for name in ("blend", "valid_blend"):
        if getattr(d, name) is not None:
            check_blend(getattr(d, name), f"data.{name}")
    packing = [n for n in PACKING_SWITCHES if getattr(d, n)]
    if not packing:
        return
    m, t = config.model, config.training
    _need(
        m.kind != "bert",
        f"data.{packing[0]} = true with model.kind = 'bert': the packed-document switches are "
        "for causal models (GPT, Llama); a BERT sample is one sentence pair already",
    )
    _need(
        not t.cuda_graphs,
        f"data.{packing[0]} = true with training.cuda_graphs = true: a captured layer takes "
        "its hidden states only, not the batch's positions and documents; turn one off",
    )
    _need(
        not (d.eod_mask_loss and t.fused_linear_cross_entropy),
        "data.eod_mask_loss = true with training.fused_linear_cross_entropy = true: the fused "
        "loss is the mean over every token; turn the fused loss off to mask the EOD positions",
    )


def _check_cuda_graphs(config: Config) -> None:
    """What a captured layer cannot do: Python that must run on every pass (the RNG
    tracker's generator swaps, recompute, the parameter gathers' hooks), a second microbatch
    in flight (its graph holds one microbatch's activations), or another graph (compile)."""
    m, p, t = config.model, config.parallel, config.training
    why = "training.cuda_graphs = true"
    _need(
        p.pipeline_model_parallel_size == 1,
        f"{why} with parallel.pipeline_model_parallel_size = "
        f"{p.pipeline_model_parallel_size}: a layer's graph holds the activations of one "
        "microbatch, and a pipeline schedule keeps several in flight; use one stage",
    )
    _need(
        m.recompute == "none",
        f"{why} with model.recompute = {m.recompute!r}: recompute swaps generator states in "
        "Python, which a replayed graph does not run; set model.recompute = 'none'",
    )
    _need(
        not t.compile,
        f"{why} with training.compile = true: choose one (compile's own CUDA graphs are not "
        "wired in)",
    )
    _need(
        not p.overlap_param_gather,
        f"{why} with parallel.overlap_param_gather = true: its forward hooks, which wait for "
        "the parameters' all-gather, would not run inside a replayed layer",
    )
    _need(
        t.precision != "fp8",
        f"{why} with training.precision = 'fp8': float8 under graphs is not proven yet",
    )
    # Under sequence parallelism every draw in a layer is per TP rank and one fork around
    # the layer (outside its graph) serves them; without it the attention's per-rank masks
    # and the hidden states' shared ones alternate inside the layer.
    _need(
        not (m.attention_dropout and p.tensor_model_parallel_size > 1 and not p.sequence_parallel),
        f"{why} with model.attention_dropout = {m.attention_dropout} at tp "
        f"{p.tensor_model_parallel_size} without sequence parallelism: the attention's masks "
        "differ between tensor-parallel ranks and the hidden states' do not, so the layer "
        "swaps generator states in Python, which a replayed graph does not run; turn on "
        "parallel.sequence_parallel or set model.attention_dropout = 0",
    )


def _check_data_parallel_sharding(config: Config) -> None:
    """parallel.data_parallel_sharding: "optimizer" and use_distributed_optimizer are one
    switch (each sets the other here); "full" (torch's FSDP2) refuses what it cannot serve
    yet, naming what to use instead."""
    p, t = config.parallel, config.training
    sharding = p.data_parallel_sharding
    _need(
        sharding in DATA_PARALLEL_SHARDINGS,
        f"parallel.data_parallel_sharding must be one of {DATA_PARALLEL_SHARDINGS}, got "
        f"{sharding!r}",
    )
    if sharding != "full":
        _need(
            p.reshard_after_forward is None,
            "parallel.reshard_after_forward is for parallel.data_parallel_sharding = 'full' "
            f"(FSDP), not {sharding!r}: leave it unset",
        )
        _need(
            not p.reduce_every_microbatch,
            "parallel.reduce_every_microbatch is for parallel.data_parallel_sharding = 'full' "
            f"(FSDP), not {sharding!r}: megacore's DDP accumulates into its fp32 buffer, "
            "which holds every gradient anyway; leave it false",
        )
        if p.use_distributed_optimizer or sharding == "optimizer":
            p.use_distributed_optimizer, p.data_parallel_sharding = True, "optimizer"
        return
    why = "parallel.data_parallel_sharding = 'full'"
    _need(
        not p.use_distributed_optimizer,
        f"{why} with parallel.use_distributed_optimizer = true: that is the 'optimizer' "
        "sharding (ZeRO-1); 'full' shards the optimizer state already: drop "
        "use_distributed_optimizer",
    )
    _need(
        not (p.reshard_after_forward and p.pipeline_model_parallel_size > 1),
        f"{why} with parallel.reshard_after_forward = true at pipeline_model_parallel_size "
        f"{p.pipeline_model_parallel_size}: a pipeline schedule runs a layer's forward and "
        "backward for several microbatches in turn, and would gather its parameters again "
        "for each; leave parallel.reshard_after_forward unset (off under pipelining)",
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
        _need(not refused, f"{why} with {message}")


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _check_sizes(config: Config) -> None:
    """Every integer of model, parallel and training is positive (vocab_size may be 0: the
    tokenizer's; seed is any)."""
    for section in ("model", "parallel", "training"):
        obj = getattr(config, section)
        for name in _field_names(type(obj)):  # (fields() once a class: the plan checks many)
            value = getattr(obj, name)
            if type(value) is int and value <= 0 and name != "seed":
                allowed_zero = name == "vocab_size"
                if allowed_zero and value == 0:
                    continue
                _need(
                    False,
                    f"{section}.{name} must be {'>= 0' if allowed_zero else '> 0'}, got {value}",
                )


def _check_model(config: Config) -> None:
    """The model's kinds and choices: kind, block order, normalization, position embedding,
    RoPE scaling, mixture of experts."""
    m = config.model
    _need(m.kind in MODEL_KINDS, f"model.kind must be one of {MODEL_KINDS}, got {m.kind!r}")
    _need(
        m.block_order in BLOCK_ORDERS,
        f"model.block_order must be one of {BLOCK_ORDERS}, got {m.block_order!r}",
    )
    _need(
        m.kind == "bert" or m.block_order == "pre_ln",
        f"model.block_order {m.block_order!r} is BERT's original order (Fig. 7 a); GPT-2 is pre_ln",
    )
    for name, choices in (("normalization", NORMALIZATIONS),
                          ("position_embedding_type", POSITION_EMBEDDING_TYPES)):  # fmt: skip
        value = getattr(m, name)
        _need(
            value is None or value in choices,
            f"model.{name} must be one of {choices}, got {value!r}",
        )
    _need(
        m.rope_scaling_factor == 0 or m.rope_scaling_factor >= 1,
        f"model.rope_scaling_factor must be 0 (off) or >= 1, got {m.rope_scaling_factor}",
    )
    _need(
        m.rope_scaling_factor == 0 or m.rope_high_freq_factor > m.rope_low_freq_factor,
        f"model.rope_high_freq_factor ({m.rope_high_freq_factor}) must be above "
        f"model.rope_low_freq_factor ({m.rope_low_freq_factor})",
    )
    _check_moe(config)


def _check_moe(config: Config) -> None:
    """The mixture-of-experts switches against each other and the model (the expert-parallel
    sizes are checked with the layout)."""
    m = config.model
    E = m.num_moe_experts
    if E is None:
        return
    why = f"model.num_moe_experts = {E}"
    _need(
        m.kind in CAUSAL_KINDS,
        f"model.num_moe_experts: MoE is built for the causal kinds {' and '.join(CAUSAL_KINDS)}, "
        f"not model.kind = {m.kind!r}",
    )
    _need(
        m.moe_router_topk <= E,
        f"model.moe_router_topk ({m.moe_router_topk}) is above model.num_moe_experts ({E})",
    )
    for section_key, choices in CHOICES.items():
        if section_key[0] == "model" and section_key[1].startswith("moe_"):
            value = getattr(m, section_key[1])
            _need(
                value in choices, f"model.{section_key[1]} must be one of {choices}, got {value!r}"
            )
    factor = m.moe_expert_capacity_factor
    _need(
        factor is None or factor > 0,
        f"model.moe_expert_capacity_factor must be > 0 (or unset: dropless), got {factor}",
    )
    freq = m.moe_layer_freq
    if isinstance(freq, list):
        _need(
            len(freq) == m.num_layers and all(v in (0, 1) for v in freq),
            f"model.moe_layer_freq: a list needs a 0 or 1 for each of the model.num_layers "
            f"({m.num_layers}) layers, got {freq!r}",
        )
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        value = getattr(m, name)
        _need(value is None or value >= 0, f"model.{name} must be >= 0, got {value}")
    scaling = m.moe_router_topk_scaling_factor
    _need(
        scaling is None or scaling > 0,
        f"model.moe_router_topk_scaling_factor must be > 0 (or unset), got {scaling}",
    )
    _need(
        not m.moe_router_enable_expert_bias or m.moe_router_score_function == "sigmoid",
        "model.moe_router_enable_expert_bias = true needs model.moe_router_score_function = "
        f"'sigmoid' (DeepSeek-V3's, as Megatron), got {m.moe_router_score_function!r}",
    )
    _need(
        not m.moe_shared_expert_gate or m.moe_shared_expert_intermediate_size,
        "model.moe_shared_expert_gate = true gates a shared expert: set "
        "model.moe_shared_expert_intermediate_size",
    )
    _need(
        not config.model_switch("add_bias_linear"),
        f"{why} with model.add_bias_linear = true: the experts have no biases (as Megatron's "
        "grouped GEMM); set model.add_bias_linear = false",
    )
    _need(
        not config.training.cuda_graphs,
        f"{why} with training.cuda_graphs = true: the tokens each expert gets change with "
        "every batch, which a captured graph cannot follow; turn one off",
    )
    _need(
        not config.training.compile,
        f"{why} with training.compile = true: compiled MoE layers are not built (torch's "
        "compiled grouped GEMM takes bf16 only, and the experts' token counts change with "
        "every batch); turn one off",
    )


def _check_training(config: Config) -> None:
    """The training switches against each other and against the model: fusion, compile,
    the data-parallel sharding, CUDA graphs, fp8, the fused loss."""
    m, p, t = config.model, config.parallel, config.training
    _need(
        not (t.gradient_accumulation_fusion and t.compile),
        "training.gradient_accumulation_fusion = true with training.compile = true: a compiled "
        "layer's backward cannot hand its weight gradients to the data-parallel buffer's "
        "hook; turn one of them off",
    )
    _check_data_parallel_sharding(config)
    if t.cuda_graphs:
        _check_cuda_graphs(config)
    if t.precision == "fp8":
        _need(
            not t.gradient_accumulation_fusion,
            "training.precision = 'fp8' with training.gradient_accumulation_fusion = true: "
            "torchao's float8 GEMMs make their own weight gradients; turn the fusion off",
        )
        _need(
            p.pipeline_schedule != "zb-h1",
            "training.precision = 'fp8' with parallel.pipeline_schedule = 'zb-h1': the deferred "
            "weight gradients would be bf16 GEMMs; choose 1f1b or interleaved",
        )
        _need(
            not p.tp_comm_overlap,
            "training.precision = 'fp8' with parallel.tp_comm_overlap = true: torchao's float8 "
            "GEMM takes the gathered input whole, so the float8 layers would keep the plain "
            "collectives; turn parallel.tp_comm_overlap off",
        )
    _need(
        not t.fp8_emulate or t.precision == "fp8",
        f"training.fp8_emulate = true with training.precision = {t.precision!r}: it emulates "
        "fp8 only",
    )
    _need(
        t.precision != "fp16" or not t.fused_linear_cross_entropy,
        "training.fused_linear_cross_entropy = true with training.precision = 'fp16': it makes "
        "the output layer's gradients in the forward, rounded to fp16 before the loss scale "
        "that keeps them representable is applied; use bf16",
    )
    _need(
        m.kind != "bert" or not t.fused_linear_cross_entropy,
        "training.fused_linear_cross_entropy = true is for GPT and Llama: BERT's masked-LM "
        "head (a transform and a bias of its own) already computes logits for the masked "
        "tokens only",
    )


def _check_masking(config: Config) -> None:
    """BERT's sample making: the masked fraction, the n-gram length, short sequences."""
    d = config.data
    _need(
        0 < d.masked_lm_prob < 1, f"data.masked_lm_prob must be in (0, 1), got {d.masked_lm_prob}"
    )
    _need(d.max_ngram >= 1, f"data.max_ngram must be >= 1, got {d.max_ngram}")
    _need(
        0 <= d.short_seq_prob <= 1,
        f"data.short_seq_prob must be in [0, 1], got {d.short_seq_prob}",
    )


def _check_layout(config: Config) -> None:
    """The model's shape against tp, pp (and virtual stages), the schedule, the sequence,
    sequence parallelism and context parallelism."""
    m, p, t = config.model, config.parallel, config.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    vpp = p.virtual_pipeline_model_parallel_size
    _need(
        m.hidden_size % m.num_attention_heads == 0,
        f"model.hidden_size ({m.hidden_size}) is not divisible by model.num_attention_heads "
        f"({m.num_attention_heads})",
    )
    _need(
        m.num_attention_heads % tp == 0,
        f"model.num_attention_heads ({m.num_attention_heads}) is not divisible by "
        f"parallel.tensor_model_parallel_size ({tp})",
    )
    if m.num_query_groups is not None:  # unset: a key/value head per head, split as the heads
        groups = m.num_query_groups
        _need(
            m.num_attention_heads % groups == 0,
            f"model.num_attention_heads ({m.num_attention_heads}) is not divisible by "
            f"model.num_query_groups ({groups})",
        )
        _need(
            groups % tp == 0 or tp % groups == 0,
            f"model.num_query_groups ({groups}) and parallel.tensor_model_parallel_size ({tp}): "
            "one must divide the other (each TP rank holds whole key/value groups; with fewer "
            "groups than TP ranks each group is replicated on tp / groups ranks)",
        )
    _need(
        config.ffn_hidden_size % tp == 0,
        f"model.ffn_hidden_size ({config.ffn_hidden_size}) is not divisible by "
        f"parallel.tensor_model_parallel_size ({tp})",
    )
    if vpp is not None and vpp > 1:
        _need(
            pp > 1,
            f"parallel.virtual_pipeline_model_parallel_size ({vpp}) needs "
            f"parallel.pipeline_model_parallel_size > 1, got {pp}",
        )
    _check_schedule(config)
    chunks = pp * (vpp or 1)
    _need(
        m.num_layers % chunks == 0,
        f"model.num_layers ({m.num_layers}) is not divisible by "
        f"parallel.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size "
        f"({pp} x {vpp or 1} = {chunks})",
    )
    _need(
        t.seq_length <= m.max_position_embeddings,
        f"training.seq_length ({t.seq_length}) is above model.max_position_embeddings "
        f"({m.max_position_embeddings}), the size of the position table",
    )
    if p.sequence_parallel:
        _need(
            t.seq_length % tp == 0,
            f"parallel.sequence_parallel needs training.seq_length ({t.seq_length}) divisible "
            f"by parallel.tensor_model_parallel_size ({tp})",
        )
    _need(
        not p.tp_comm_overlap or (tp > 1 and p.sequence_parallel),
        "parallel.tp_comm_overlap = true overlaps sequence parallelism's all-gathers and "
        "reduce-scatters with the GEMMs: it needs parallel.tensor_model_parallel_size > 1 "
        f"(it is {tp}) and parallel.sequence_parallel = true (it is "
        f"{str(p.sequence_parallel).lower()}); set them, or parallel.tp_comm_overlap = false",
    )
    _need(
        p.use_distributed_optimizer or not p.overlap_param_gather,
        "parallel.overlap_param_gather overlaps the distributed optimizer's parameter "
        "all-gather: it needs parallel.use_distributed_optimizer = true",
    )
    _need(
        not (p.sequence_parallel and p.distribute_saved_activations and tp > 1),
        "parallel.distribute_saved_activations keeps 1/tp of each layer's input, which must be "
        "the same on every TP rank; under parallel.sequence_parallel it is already split: "
        "turn one of them off",
    )
    _check_context_parallel(config)


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
        _need(
            world_size % (tp * cp * pp) == 0,
            f"the job has {world_size} processes, not divisible by parallel.{sizes}",
        )
        dp = world_size // (tp * cp * pp)
        layout = f"tp {tp} x cp {cp} x pp {pp}" if cp > 1 else f"tp {tp} x pp {pp}"
        _need(
            p.data_parallel_size in (None, dp),
            f"parallel.data_parallel_size is {p.data_parallel_size}, but the job has "
            f"{world_size} processes = {layout} x dp {dp}",
        )
    per_step = t.micro_batch_size * dp
    _need(
        t.global_batch_size % per_step == 0,
        f"training.global_batch_size ({t.global_batch_size}) is not divisible by "
        f"training.micro_batch_size x data-parallel size ({t.micro_batch_size} x {dp} = "
        f"{per_step})",
    )
    if vpp is not None and vpp > 1:
        microbatches = t.global_batch_size // per_step
        _need(
            microbatches % pp == 0,
            f"the interleaved schedule needs the number of microbatches (global_batch_size / "
            f"(micro_batch_size x dp) = {microbatches}) to be a multiple of "
            f"parallel.pipeline_model_parallel_size ({pp})",
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
        _need(
            ep == 1 and p.expert_tensor_parallel_size is None,
            "parallel.expert_model_parallel_size / expert_tensor_parallel_size split the "
            "experts of a mixture of experts: set model.num_moe_experts, or leave them unset",
        )
        return
    _need(
        E % ep == 0,
        f"model.num_moe_experts ({E}) is not divisible by parallel.expert_model_parallel_size "
        f"({ep}): each expert-parallel rank holds the same number of experts",
    )
    f = m.moe_ffn_hidden_size or config.ffn_hidden_size
    name = "model.moe_ffn_hidden_size" if m.moe_ffn_hidden_size else "model.ffn_hidden_size"
    _need(
        f % etp == 0,
        f"{name} ({f}, each expert's) is not divisible by the expert tensor-parallel size "
        f"({etp}, parallel.expert_tensor_parallel_size or else tensor_model_parallel_size)",
    )
    _need(
        tp == 1 or p.sequence_parallel,
        f"model.num_moe_experts with parallel.tensor_model_parallel_size = {tp} needs "
        "parallel.sequence_parallel = true (Megatron's rule): without it every TP rank holds "
        "the same tokens, and the experts, reached from every TP rank, would take each token "
        f"{tp} times",
    )
    if world_size is not None:
        _need(
            world_size % (etp * ep * pp) == 0,
            f"the job has {world_size} processes, not divisible by the expert layout "
            f"parallel.expert_tensor_parallel_size x expert_model_parallel_size x "
            f"pipeline_model_parallel_size ({etp} x {ep} x {pp} = {etp * ep * pp})",
        )
    _need(
        p.data_parallel_sharding != "full" or (ep == 1 and etp == tp),
        "parallel.data_parallel_sharding = 'full' with experts split over ranks "
        f"(expert_model_parallel_size {ep}, expert tensor-parallel size {etp}): FSDP would "
        "shard the experts over the dense data-parallel group, not theirs; use 'optimizer'",
    )


def _check_checkpoint(config: Config) -> None:
    c = config.checkpoint
    _need(
        c.save_interval is None or c.save_interval > 0,
        f"checkpoint.save_interval must be > 0, got {c.save_interval}",
    )
    _need(c.keep >= 0, f"checkpoint.keep must be >= 0 (0 keeps all), got {c.keep}")
    _need(
        c.async_save_timeout > 0,
        f"checkpoint.async_save_timeout must be > 0 seconds, got {c.async_save_timeout}",
    )


def _check_optimizer(config: Config) -> None:
    o, t = config.optimizer, config.training
    _need(
        0 <= o.min_lr <= o.lr,
        f"optimizer.min_lr ({o.min_lr}) must be between 0 and optimizer.lr ({o.lr})",
    )
    decay = o.lr_decay_iters or t.train_iters
    _need(
        o.lr_warmup_iters <= decay,
        f"optimizer.lr_warmup_iters ({o.lr_warmup_iters}) is above the decay length "
        f"(optimizer.lr_decay_iters or training.train_iters = {decay})",
    )


def _check_dropout(config: Config) -> None:
    m = config.model
    _need(
        not (m.hidden_dropout < 0 or m.hidden_dropout >= 1 or math.isnan(m.hidden_dropout)),
        f"model.hidden_dropout must be in [0, 1), got {m.hidden_dropout}",
    )
    _need(
        0 <= m.attention_dropout < 1,
        f"model.attention_dropout must be in [0, 1), got {m.attention_dropout}",
    )


def validate(config: Config, world_size: int | None = None) -> int:
    """Check every size the layout depends on; return the data-parallel size.

    `world_size` is the number of processes the job has (None: the config's own
    data_parallel_size, or 1, times tp x pp).

    The checks run section by section in a fixed order: the first refusal is the one a
    config with several faults gets, so the order is part of the messages' contract.
    """
    _check_sizes(config)
    _check_model(config)
    _check_training(config)
    _check_data(config)
    _check_masking(config)
    _check_layout(config)
    dp = _data_parallel_size(config, world_size)
    _check_expert_parallel(config, world_size)
    _check_checkpoint(config)
    _check_optimizer(config)
    _check_dropout(config)
    return dp
