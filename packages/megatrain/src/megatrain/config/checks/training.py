"""[training]: its switches against each other and the model (fusion, compile, CUDA
graphs, fp8, the fused loss).
"""

from megatrain.config.checks.parallel import _check_data_parallel_sharding
from megatrain.config.errors import ConfigError
from megatrain.config.sections import Config


def _check_training(config: Config) -> None:
    """The training switches against each other and against the model: fusion, compile,
    the data-parallel sharding, CUDA graphs, fp8, the fused loss."""
    m, p, t = config.model, config.parallel, config.training
    if t.gradient_accumulation_fusion and t.compile:
        raise ConfigError(
            "training.gradient_accumulation_fusion = true with training.compile = true: a compiled "
            "layer's backward cannot hand its weight gradients to the data-parallel buffer's "
            "hook; turn one of them off"
        )
    _check_data_parallel_sharding(config)
    if t.cuda_graphs:
        _check_cuda_graphs(config)
    if t.precision == "fp8":
        if t.gradient_accumulation_fusion:
            raise ConfigError(
                "training.precision = 'fp8' with training.gradient_accumulation_fusion = true: "
                "torchao's float8 GEMMs make their own weight gradients; turn the fusion off"
            )
        if p.pipeline_schedule == "zb-h1":
            raise ConfigError(
                "training.precision = 'fp8' with parallel.pipeline_schedule = 'zb-h1': the "
                "deferred weight gradients would be bf16 GEMMs; choose 1f1b or interleaved"
            )
        if p.tp_comm_overlap:
            raise ConfigError(
                "training.precision = 'fp8' with parallel.tp_comm_overlap = true: torchao's float8 "
                "GEMM takes the gathered input whole, so the float8 layers would keep the plain "
                "collectives; turn parallel.tp_comm_overlap off"
            )
    if t.fp8_emulate and t.precision != "fp8":
        raise ConfigError(
            f"training.fp8_emulate = true with training.precision = {t.precision!r}: it emulates "
            "fp8 only"
        )
    if t.precision == "fp16" and t.fused_linear_cross_entropy:
        raise ConfigError(
            "training.fused_linear_cross_entropy = true with training.precision = 'fp16': it makes "
            "the output layer's gradients in the forward, rounded to fp16 before the loss scale "
            "that keeps them representable is applied; use bf16"
        )
    if m.kind == "bert" and t.fused_linear_cross_entropy:
        raise ConfigError(
            "training.fused_linear_cross_entropy = true is for GPT and Llama: BERT's masked-LM "
            "head (a transform and a bias of its own) already computes logits for the masked "
            "tokens only"
        )


def _check_cuda_graphs(config: Config) -> None:
    """What a captured layer cannot do: Python that must run on every pass (the RNG
    tracker's generator swaps, recompute, the parameter gathers' hooks), a second microbatch
    in flight (its graph holds one microbatch's activations), or another graph (compile)."""
    m, p, t = config.model, config.parallel, config.training
    why = "training.cuda_graphs = true"
    if p.pipeline_model_parallel_size != 1:
        raise ConfigError(
            f"{why} with parallel.pipeline_model_parallel_size = "
            f"{p.pipeline_model_parallel_size}: a layer's graph holds the activations of one "
            "microbatch, and a pipeline schedule keeps several in flight; use one stage"
        )
    if m.recompute != "none":
        raise ConfigError(
            f"{why} with model.recompute = {m.recompute!r}: recompute swaps generator states in "
            "Python, which a replayed graph does not run; set model.recompute = 'none'"
        )
    if t.compile:
        raise ConfigError(
            f"{why} with training.compile = true: choose one (compile's own CUDA graphs are not "
            "wired in)"
        )
    if p.overlap_param_gather:
        raise ConfigError(
            f"{why} with parallel.overlap_param_gather = true: its forward hooks, which wait for "
            "the parameters' all-gather, would not run inside a replayed layer"
        )
    if t.precision == "fp8":
        raise ConfigError(
            f"{why} with training.precision = 'fp8': float8 under graphs is not proven yet"
        )
    # Under sequence parallelism every draw in a layer is per TP rank and one fork around
    # the layer (outside its graph) serves them; without it the attention's per-rank masks
    # and the hidden states' shared ones alternate inside the layer.
    if m.attention_dropout and p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
        raise ConfigError(
            f"{why} with model.attention_dropout = {m.attention_dropout} at tp "
            f"{p.tensor_model_parallel_size} without sequence parallelism: the attention's masks "
            "differ between tensor-parallel ranks and the hidden states' do not, so the layer "
            "swaps generator states in Python, which a replayed graph does not run; turn on "
            "parallel.sequence_parallel or set model.attention_dropout = 0"
        )
