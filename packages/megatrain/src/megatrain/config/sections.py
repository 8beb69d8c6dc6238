"""The sections of a run config as dataclasses (`Config` holds one of each), their
defaults, and the names of the choices their fields take (`CHOICES`).
"""

import dataclasses
from dataclasses import dataclass, field

# megacore.pipeline_parallel.SCHEDULES, named here so reading a config needs no torch (a
# test holds the two equal).
PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1")
DATA_PARALLEL_SHARDINGS = ("none", "optimizer", "full")


# Activation recompute modes, the cheapest in compute first.
RECOMPUTE_CHOICES = ("none", "selective", "full")
MODEL_KINDS = ("gpt", "bert", "llama")
# The kinds that are causal language models (trained and scored token by token).
CAUSAL_KINDS = ("gpt", "llama")
BLOCK_ORDERS = ("pre_ln", "post_ln")
NORMALIZATIONS = ("layernorm", "rmsnorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
ROPE_TYPES = ("rope", "yarn")
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
    # The k weights divided by their sum (HF's norm_topk_prob): with pre_softmax, Qwen3-MoE
    # true, Qwen2-MoE and DeepSeek-V2 false; with sigmoid, HF's DeepSeek-V3 switch.  Unset:
    # the score function's own (Megatron's: sigmoid normalized when k > 1, softmax not).
    moe_router_norm_topk_prob: bool | None = None
    # The weights times this, after any normalization (HF's routed_scaling_factor).
    moe_router_topk_scaling_factor: float | None = None
    # DeepSeek's group-limited routing (Megatron-LM's names; HF's n_group and topk_group): the
    # experts in moe_router_num_groups groups of consecutive ids, each token choosing among
    # the experts of its moe_router_group_topk best groups only, a group ranked by the sum of
    # its moe_router_group_score_topk best scores (unset: moe_router_topk //
    # moe_router_group_topk, Megatron's; HF's DeepSeek-V3 sums 2, DeepSeek-V2's
    # group_limited_greedy 1: the group's max).
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_group_score_topk: int | None = None
    # Under expert parallelism, whole routing groups on each EP rank (moe_router_num_groups a
    # multiple of parallel.expert_model_parallel_size), so a token's experts lie on at most
    # moe_router_group_topk ranks, and the all-to-all sends each token once to each of those
    # ranks (not once per chosen expert), which sums the token's expert outputs and sends one
    # row back (DeepSeek-V3's node-limited dispatch).  The same numbers as without it.
    moe_group_limited_dispatch: bool = False
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
    # Biases in the attention and MLP linears (with experts: the router's and each expert's
    # two GEMMs' too, as Megatron-LM's; gpt-oss).
    add_bias_linear: bool | None = None
    # The gated MLP's activation (model.swiglu true: dense, shared and routed experts alike):
    # quick-GeGLU, gate x sigmoid(1.702 gate), in place of SiLU (Megatron-LM's quick_geglu),
    # glu_linear_offset added to the up half, and when set the gate clamped to at most
    # activation_func_clamp_value and the up half to [-it, it] first (Megatron-LM's names;
    # gpt-oss: quick_geglu, 1.0 and 7.0).
    quick_geglu: bool = False
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
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
    # Sliding-window attention (Mistral, Qwen2, Gemma, gpt-oss): a causal query sees itself and
    # the window_size - 1 keys before it (HF's sliding_window); None: every earlier key.
    # layer_types names each layer "sliding_attention" or "full_attention" (HF's list, e.g.
    # gpt-oss's alternation); None: every layer sliding when window_size is set.
    window_size: int | None = None
    layer_types: list | None = None
    # "vanilla", or "learnable": a learned logit per head joins the softmax's denominator
    # (attention sinks, gpt-oss; megatron-core's softmax_type).
    softmax_type: str = "vanilla"
    rotary_base: float = 10000.0  # HF's rope_theta
    # Llama 3.1's frequency scaling of the rotary embeddings (HF rope_scaling type "llama3");
    # factor 0 = off.
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    # Which rotary scaling (Megatron-LM's rope_type): "rope" (none, or Llama 3.1's with
    # rope_scaling_factor) or "yarn" (YaRN, HF rope_type "yarn": DeepSeek-V2/V3, gpt-oss),
    # with Megatron-LM's names for its fields: the context's stretch (HF's factor), the
    # pretraining context, the correction range's rotations, the magnitude scales (0 =
    # unset: HF's attention factor from the factor alone, no softmax mscale) and whether the
    # correction range is rounded outwards (HF's truncate; gpt-oss false).
    rope_type: str = "rope"
    rotary_scaling_factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    correction_range_round_to_int: bool = True
    # DeepSeek-V2/V3's multi-latent attention (models.attention.multi_latent; Megatron-LM's
    # names): queries through a q_lora_rank latent (unset: projected directly), keys and
    # values from one kv_lora_rank latent with a shared qk_pos_emb_head_dim rope key, heads
    # of qk_head_dim (no-rope part) + qk_pos_emb_head_dim for queries and keys, v_head_dim
    # for values.  Needs rotary positions; not with num_query_groups, kv_channels,
    # qk_layernorm or add_qkv_bias, whose jobs its own sizes do.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # DeepSeek-V3's multi-token prediction (models.mtp; Megatron-LM's names): depth k of
    # mtp_num_layers predicts the token k + 1 places past the next through one transformer
    # layer of its own; the depths' mean loss times mtp_loss_scaling_factor joins the LM loss
    # (GPT and Llama kinds).  None: no MTP.
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    # Megatron-LM's --pipeline-model-parallel-layout: the layers of every virtual stage, for a
    # split num_layers does not divide evenly (DeepSeek-V3's 61).  A string, stages split by
    # '|' in model order (chunk c of rank r is stage c x pp + r): E the embedding, t a
    # transformer layer, m a multi-token-prediction depth, L the output layer and loss, X*n and
    # (...)*n repeat ("Et*4|(t*4|)*14tL": 4 layers a stage over pp 4 x vpp 4, the last 1); or
    # Megatron-Bridge's list of stages, each a list of "embedding", "decoder", "mtp", "loss".
    # E opens the first stage; the MTP depths and L close the last; a stage may hold no t.
    # None: the layers split evenly.
    pipeline_model_parallel_layout: str | list | None = None
    # "1f1b", "interleaved" (the one with virtual stages) or "zb-h1" (backwards split into
    # input and weight gradients, the weight gradients filling the bubble); None = the
    # layout's: interleaved with virtual stages, else 1f1b.
    pipeline_schedule: str | None = None
    # None = whatever the world gives: world size / (tp x cp x pp).
    data_parallel_size: int | None = None
    # Context parallelism: each sequence split over this many ranks (2 x cp chunks, rank r
    # holding chunks r and 2cp-1-r), megatron-core's order tp-cp-dp-pp.  Attention by
    # cp_comm_type: "p2p" (a ring passing K/V blocks, overlapped), "allgather" (Llama 3's), or,
    # with model.multi_latent_attention only, "latent" (the compressed KV latent and the rope
    # key all-gathered, K/V up-projected on each rank for the whole sequence).
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
    # Start from a Hugging Face Llama-family model's files (a directory with config.json and
    # safetensors), read at this run's layout, each rank its own slices (megatrain.hf.layout_load);
    # a `save` directory that holds a checkpoint resumes from it instead.  Not with `load`.
    load_hf: str | None = None
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
    ("model", "rope_type"): ROPE_TYPES,
    ("optimizer", "lr_decay_style"): ("cosine", "linear", "constant"),
    ("training", "precision"): ("fp32", "bf16", "fp16", "fp8"),
    ("parallel", "cp_comm_type"): ("p2p", "allgather", "latent"),
    ("parallel", "data_parallel_sharding"): DATA_PARALLEL_SHARDINGS,
    ("model", "moe_router_score_function"): MOE_SCORE_FUNCTIONS,
    ("model", "moe_router_load_balancing_type"): MOE_LOAD_BALANCING_TYPES,
    ("model", "moe_token_drop_policy"): MOE_DROP_POLICIES,
    ("model", "moe_token_dispatcher_type"): MOE_TOKEN_DISPATCHER_TYPES,
}
