"""Memory per GPU of a training config, and the cheapest recompute mode that fits a GPU.

An estimate of the steady state of training, per pipeline stage, in bytes:

- **Weights and optimizer**: this stage's parameters on one TP rank (the sharded
  matrices / tp, the replicated biases and LayerNorms whole) times the bytes per
  parameter of megacore's optimizer (its module docstring): fp32 16 (weights and
  grads 4 each, Adam's two moments 8); fp16/bf16 18 (16-bit weights 2, fp32 grads 4,
  fp32 master and moments 12).  Under `use_distributed_optimizer` the fp32 state is
  sharded over data parallelism: 8 + 8/d and 6 + 12/d.
- **Activations** (Korthikanti et al. 2022, section 4; 16-bit activations, 1-byte
  dropout masks) per layer per microbatch, s sequence, b micro batch, h hidden,
  a heads, t tp:

      none       s b h (34 + 5 a s / h)                     tp 1
                 s b h (10 + 24/t + 5 a s / (h t))          tp t
                 s b h (34/t + 5 a s / (h t))               tp t, sequence parallel
      selective  the same without the 5 a s / h term (the attention core's s x s tensors)
      full       2 s b h, the layer's input (/ t with sequence parallelism or
                 distribute_saved_activations), plus one layer's "none" activations,
                 rebuilt during its backward

  times the stage's layers times the microbatches in flight: under 1F1B stage 0
  holds pp of them (interleaved: times 1 + (pp - 1) / (pp vpp)), the last stage one;
  without pipelining one.  Stage 0 adds the embedding dropout mask (s b h per
  microbatch, / t with sequence parallelism); the last stage the output layer's
  input, the final LayerNorm's and the fp32 logits the loss keeps (the paper's
  4 s b h / t (1 + v / h)).  fp32 activations count twice the 16-bit bytes.

Not counted: the CUDA context, library workspaces, communication buffers and
fragmentation; `fits` keeps a headroom (10%) for them.  The 5 a s / h term is what
attention that materializes its s x s scores keeps; the fused SDPA kernels (flash,
memory-efficient) keep only their output and a row statistic, so "none" is an
upper bound there and the choice it leads to a safe one.
"""

from megatrain.config import RECOMPUTE_CHOICES, Config
from megatrain.models import model_config
from megatrain.models.bert import MASKED_LM_PROB
from megatrain.models.transformer import TransformerConfig
from megatrain.plan.hardware import GIB as GIB  # re-exported: sizes in GiB
from megatrain.plan.hardware import load_gpus

# Memory of the GPUs configs are sized for: the GPU table of `megatrain plan` (plan/gpus.toml).
GPU_MEMORY = {key: gpu.memory_bytes for key, gpu in load_gpus().items()}
HEADROOM = 0.1


def state_bytes_per_parameter(
    precision: str, distributed_optimizer: bool, dp: int
) -> dict[str, float]:
    """megacore's optimizer table split by what holds the bytes: the model's weights (2 in
    16 bits, 4 in fp32), the fp32 gradient buffer (4), and the optimizer's state (fp32 master
    weights when the model is 16-bit, Adam's two moments: 12 or 8), sharded over dp by the
    distributed optimizer."""
    optimizer = 8 if precision == "fp32" else 12
    return {
        "weights": 4 if precision == "fp32" else 2,
        "gradients": 4,
        "optimizer_state": optimizer / dp if distributed_optimizer else optimizer,
    }


def _layer_parameters_per_rank(cfg: TransformerConfig, tp: int) -> int:
    """One layer's parameters on one TP rank: the split matrices and column biases / tp, the
    row-parallel biases and the LayerNorms whole (as `num_parameters` counts them, at tp 1)."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    split = 3 * h * h + 3 * h + h * h + h * f + f + f * h
    replicated = h + h + 4 * h  # proj bias, fc2 bias, two LayerNorms
    return split // tp + replicated


def parameters_per_gpu(cfg: TransformerConfig, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
    """Parameters one GPU of pipeline stage `stage` holds (a last stage's copy of the tied
    embeddings included).  At tp = pp = 1 this is the model's `parameter_count`.  A
    bidirectional config is BERT: token types, and its heads on the last stage."""
    h = cfg.hidden_size
    count = cfg.num_layers // pp * _layer_parameters_per_rank(cfg, tp)
    words = cfg.vocab_size * h // tp
    if stage == 0:
        count += words + (cfg.max_position_embeddings + cfg.num_tokentypes) * h
        if cfg.block_order == "post_ln":
            count += 2 * h  # the embeddings' LayerNorm
    if stage == pp - 1:
        if cfg.block_order == "pre_ln":
            count += 2 * h  # final LayerNorm
        if pp > 1:
            count += words  # the output layer's copy of the word embeddings
        if not cfg.causal:  # BERT's LM head (dense, LayerNorm, vocab-split bias), pooler, SOP
            count += (h * h + h) + 2 * h + cfg.vocab_size // tp + (h * h + h) + (2 * h + 2)
    return count


def activations_per_layer(config: Config, recompute: str) -> float:
    """Bytes one layer keeps for one microbatch (16-bit; module docstring)."""
    m, p, t = config.model, config.parallel, config.training
    s, b, h, a = t.seq_length, t.micro_batch_size, m.hidden_size, m.num_attention_heads
    tp = p.tensor_model_parallel_size
    sp = p.sequence_parallel and tp > 1
    if recompute == "full":
        split_input = sp or (p.distribute_saved_activations and tp > 1)
        return 2 * s * b * h / (tp if split_input else 1)
    dense = 34 / tp if sp else 10 + 24 / tp
    core = 0.0 if recompute == "selective" else 5 * a * s / (h * tp)
    return s * b * h * (dense + core)


def memory_breakdown(
    config: Config,
    recompute: str | None = None,
    *,
    vocab_size: int | None = None,
    data_parallel_size: int | None = None,
    stage: int = 0,
) -> dict[str, float]:
    """Bytes per GPU of pipeline stage `stage`: parameters (count), weights, gradients,
    optimizer_state, their sum weights_and_optimizer, activations, total.  `recompute`
    defaults to the config's; `vocab_size` (the tokenizer's, before padding) to
    `model.vocab_size`; the data-parallel size (which only the distributed optimizer's
    sharding depends on) to `parallel.data_parallel_size` or 1."""
    m, p, t = config.model, config.parallel, config.training
    recompute = m.recompute if recompute is None else recompute
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_CHOICES}, not {recompute!r}")
    vocab_size = vocab_size or m.vocab_size
    if not vocab_size:
        raise ValueError(
            "memory_breakdown: model.vocab_size is 0 (taken from the corpus); pass vocab_size="
        )
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    vpp = p.virtual_pipeline_model_parallel_size or 1
    dp = data_parallel_size or p.data_parallel_size or 1
    cfg = model_config(config, vocab_size)
    params = parameters_per_gpu(cfg, tp, pp, stage)
    held = state_bytes_per_parameter(t.precision, p.use_distributed_optimizer, dp)
    held = {name: params * per_parameter for name, per_parameter in held.items()}
    state = sum(held.values())

    s, b, h, v = t.seq_length, t.micro_batch_size, m.hidden_size, cfg.vocab_size
    sp = p.sequence_parallel and tp > 1
    per_microbatch = cfg.num_layers // pp * activations_per_layer(config, recompute)
    if stage == 0:
        per_microbatch += s * b * h / (tp if sp else 1)  # embedding dropout mask
    in_flight = 1.0
    if pp > 1 and stage == 0:  # 1F1B's warm-up; the interleaved one runs further ahead
        in_flight = pp * (1 + (pp - 1) / (pp * vpp)) if vpp > 1 else pp
        # ... but never more microbatches than the iteration has
        in_flight = min(in_flight, t.global_batch_size // (b * dp) or 1)
    activations = in_flight * per_microbatch
    if recompute == "full":  # the layer being recomputed holds all of its activations
        activations += activations_per_layer(config, "none")
    if stage == pp - 1:  # one microbatch reaches the loss at a time
        # BERT's masked LM takes the logits of the predicted tokens only.
        predicted = 1.0 if cfg.causal else MASKED_LM_PROB
        activations += 4 * s * b * h / tp * (1 + v / h) * predicted
    if t.precision == "fp32":
        activations *= 2
    return {
        "parameters": params,
        **held,
        "weights_and_optimizer": state,
        "activations": activations,
        "total": state + activations,
    }


def estimate_memory_per_gpu(config: Config, recompute: str | None = None, **kwargs) -> float:
    """Bytes per GPU of the fullest pipeline stage (see `memory_breakdown` for the arguments)."""
    pp = config.parallel.pipeline_model_parallel_size
    return max(
        memory_breakdown(config, recompute, stage=stage, **kwargs)["total"] for stage in {0, pp - 1}
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
