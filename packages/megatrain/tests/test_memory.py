"""Memory per GPU (`megatrain.plan.memory`) and the recompute the shipped configs choose by it."""

from pathlib import Path

import pytest

from megatrain.config import load_config
from megatrain.models import model_config
from megatrain.plan.accounting import gpt_parameters as num_parameters
from megatrain.plan.accounting import parameter_count, parameters_per_gpu
from megatrain.plan.memory import (
    GIB,
    GPU_MEMORY,
    cheapest_recompute,
    estimate_memory_per_gpu,
    memory_breakdown,
)

MODELS = Path(__file__).resolve().parents[3] / "pipelines" / "models"
GPT2_VOCAB = 50257
# What each shipped config is sized for: the paper trained every size on 32 GB V100s
# (DGX-2H); gpt2-tiny is for a laptop, whose vocabulary comes from the corpus (GPT-2's at most).
TARGETS = {
    "gpt2-355m": GPU_MEMORY["v100-32gb"],
    "gpt2-1.2b": GPU_MEMORY["v100-32gb"],
    "gpt2-2.5b": GPU_MEMORY["v100-32gb"],
    "gpt2-4.2b": GPU_MEMORY["v100-32gb"],
    "gpt2-8.3b": GPU_MEMORY["v100-32gb"],
    "gpt2-tiny": 8 * GIB,
    "bert-336m": GPU_MEMORY["v100-32gb"],
    "bert-1.3b": GPU_MEMORY["v100-32gb"],
    "bert-3.9b": GPU_MEMORY["v100-32gb"],
    "bert-tiny": 8 * GIB,
    "llama-tiny": 8 * GIB,
    "mixtral-tiny": 8 * GIB,
    "gpt2-tiny-blend": 8 * GIB,
    "llama3-8b": GPU_MEMORY["h100-80gb"],
    "llama3-8b-32k": GPU_MEMORY["h100-80gb"],
    "llama3-8b-128k": GPU_MEMORY["h100-80gb"],
    "llama3-70b": GPU_MEMORY["h100-80gb"],
    "mixtral-8x7b": GPU_MEMORY["h100-80gb"],
    "qwen3-30b-a3b": GPU_MEMORY["h100-80gb"],
    "gpt-oss-tiny": 8 * GIB,
    "gpt-oss-20b": GPU_MEMORY["h100-80gb"],
    "gpt-oss-120b": GPU_MEMORY["h100-80gb"],
    "deepseek-tiny": 8 * GIB,
    "deepseek-v2-lite": GPU_MEMORY["h100-80gb"],
    "moonlight-16b-a3b": GPU_MEMORY["h100-80gb"],
    "deepseek-v3": GPU_MEMORY["h100-80gb"],
}


def _shipped(name: str):
    config = load_config(MODELS / f"{name}.toml")
    return config, config.model.vocab_size or GPT2_VOCAB


def test_every_shipped_config_has_a_target():
    assert {p.stem for p in MODELS.glob("*.toml")} == set(TARGETS)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_shipped_recompute_is_the_cheapest_that_fits(name):
    """Changing a config, or the estimate, keeps the choice honest: none if it fits with 10%
    to spare, else selective, else full."""
    config, vocab = _shipped(name)
    estimates = {
        mode: estimate_memory_per_gpu(config, mode, vocab_size=vocab)
        for mode in ("none", "selective", "full")
    }
    assert estimates["none"] >= estimates["selective"] >= estimates["full"]
    chosen = cheapest_recompute(config, TARGETS[name], vocab_size=vocab)
    assert config.model.recompute == chosen, {m: round(b / GIB, 1) for m, b in estimates.items()}
    assert estimates[chosen] <= 0.9 * TARGETS[name]  # every shipped config fits its GPU


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_parameter_term_is_num_parameters(name):
    """One GPU holds the whole model at tp = pp = 1; over a tp x pp layout the ranks hold it
    once, plus the replicated pieces on every TP rank and the last stage's embedding copy."""
    config, vocab = _shipped(name)
    config.parallel.tensor_model_parallel_size = config.parallel.pipeline_model_parallel_size = 1
    config.parallel.expert_model_parallel_size = 1  # every expert on the one GPU
    cfg = model_config(config, vocab)
    kind = config.model.kind
    assert memory_breakdown(config, vocab_size=vocab)["parameters"] == parameter_count(kind, cfg)
    if kind != "gpt":
        return  # the layout sums below count GPT's replicated pieces
    tp, pp = 4, 2
    config.parallel.tensor_model_parallel_size = tp
    config.parallel.pipeline_model_parallel_size = pp
    cfg = model_config(config, vocab)  # padded for tp 4
    h = cfg.hidden_size
    replicated = cfg.num_layers * 6 * h + cfg.max_position_embeddings * h + 2 * h
    held = tp * sum(parameters_per_gpu(cfg, tp, pp, stage) for stage in range(pp))
    assert held == num_parameters(cfg) + (tp - 1) * replicated + cfg.vocab_size * h


def test_the_355m_estimate_by_hand():
    """Korthikanti et al. 2022 at s 1024, b 8, h 1024, a 16, 24 layers, tp 1, fp16 Adam."""
    config, vocab = _shipped("gpt2-355m")
    s, b, h, a, n, v = 1024, 8, 1024, 16, 24, 50304  # vocabulary padded to 128
    params = num_parameters(model_config(config, vocab))
    logits = 4 * s * b * h * (1 + v / h)
    embedding = s * b * h
    by_mode = {
        "none": n * s * b * h * (34 + 5 * a * s / h),
        "selective": n * s * b * h * 34,
        "full": n * 2 * s * b * h + s * b * h * (34 + 5 * a * s / h),
    }
    for mode, layers in by_mode.items():
        got = memory_breakdown(config, mode, vocab_size=vocab)
        assert got["weights_and_optimizer"] == 18 * params
        assert got["activations"] == pytest.approx(layers + embedding + logits)
    assert estimate_memory_per_gpu(config, "none") / GIB == pytest.approx(28.9, abs=0.05)


def test_the_fused_loss_holds_gradients_not_logits():
    """The 355M's last stage with the fused linear + cross entropy: instead of the fp32
    logits, the output layer's input and its gradient, the weight's fp32 gradient and one
    GPU chunk (2^26 / v tokens) of fp32 logits."""
    config, vocab = _shipped("gpt2-355m")
    config.training.precision = "bf16"  # fp16 is refused with the fused loss
    s, b, h, v = 1024, 8, 1024, 50304
    plain = memory_breakdown(config, "selective", vocab_size=vocab)
    config.training.fused_linear_cross_entropy = True
    fused = memory_breakdown(config, "selective", vocab_size=vocab)
    chunk = 4 * (2**26 // v) * v
    held = 4 * s * b * h + 4 * v * h + chunk
    assert fused["activations"] - plain["activations"] == pytest.approx(
        held - 4 * s * b * h * (1 + v / h)
    )
    # 1.5 GiB of fp32 logits for 0.2 GiB of weight gradient and a 0.25 GiB chunk.
    assert fused["activations"] < plain["activations"] - GIB


def test_cuda_graphs_hold_static_inputs_outputs_and_unfused_gradients():
    """The 355M with each layer a CUDA graph: every layer's input copy and output (16-bit
    [s, b, h] each), and the weights' 16-bit gradients unless they go into main_grad."""
    from megatrain.models import model_config
    from megatrain.plan.accounting import layer_parameters_per_rank

    config, vocab = _shipped("gpt2-355m")
    config.training.precision = "bf16"
    s, b, h, n = 1024, 8, 1024, 24
    plain = memory_breakdown(config, "none", vocab_size=vocab)["activations"]
    config.training.cuda_graphs = True
    graphs = memory_breakdown(config, "none", vocab_size=vocab)["activations"]
    grads = n * layer_parameters_per_rank(model_config(config, vocab), 1) * 2
    assert graphs - plain == pytest.approx(n * 4 * s * b * h + grads)
    config.training.gradient_accumulation_fusion = True
    fused = memory_breakdown(config, "none", vocab_size=vocab)["activations"]
    assert fused - plain == pytest.approx(n * 4 * s * b * h)


def test_layouts_that_save_memory_estimate_less():
    config, vocab = _shipped("gpt2-8.3b")  # tp 8, full recompute
    base = memory_breakdown(config, "selective", vocab_size=vocab)
    config.parallel.sequence_parallel = True  # the 10 s b h per layer split over tp
    sp = memory_breakdown(config, "selective", vocab_size=vocab)
    assert sp["activations"] < base["activations"]
    config.parallel.use_distributed_optimizer = True  # fp32 state over 8 data-parallel ranks
    sharded = memory_breakdown(config, "selective", vocab_size=vocab, data_parallel_size=8)
    assert sharded["weights_and_optimizer"] == pytest.approx(
        base["weights_and_optimizer"] * (6 + 12 / 8) / 18
    )
    # Pipelining: the first stage holds pp microbatches of half the layers, the last one.
    config = load_config(MODELS / "gpt2-8.3b.toml", ["parallel.pipeline_model_parallel_size=2"])
    first, last = (memory_breakdown(config, vocab_size=vocab, stage=i) for i in (0, 1))
    assert first["activations"] > last["activations"]
    assert estimate_memory_per_gpu(config, vocab_size=vocab) == max(first["total"], last["total"])


def test_context_parallelism_divides_the_activations():
    """Llama 3 8B at 32k tokens, tp 2 with sequence parallelism: at cp 2, 4 and 8 every
    per-token activation (recompute selective: the layers', the embedding's mask, the logits)
    is exactly 1/cp of cp 1's; under "none" each layer keeps besides what the attention over
    the whole sequence keeps (the other ranks' K/V and the additive mask, or the ring's float32
    scores), one layer's attention holds its boolean mask or the ring's score gradients while
    it runs, and the weights, gradients and optimizer state do not change (the distributed
    optimizer shards over dp x cp)."""
    from megatrain.plan.accounting import (
        activations_per_layer,
        context_parallel_attention_per_layer,
        context_parallel_attention_working,
    )

    base = ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=1"]
    base += ["parallel.virtual_pipeline_model_parallel_size=none", "training.micro_batch_size=1"]
    base += ["parallel.use_distributed_optimizer=false"]

    def at(cp, comm="allgather", *more):
        overrides = [
            *base,
            f"parallel.context_parallel_size={cp}",
            f"parallel.cp_comm_type={comm!r}",
        ]
        return load_config(MODELS / "llama3-8b-32k.toml", [*overrides, *more])

    vocab = 128256
    one = memory_breakdown(at(1), "selective", vocab_size=vocab)
    assert context_parallel_attention_per_layer(at(1)) == 0
    assert context_parallel_attention_working(at(1)) == 0
    s, b, h, groups, d = 32768, 1, 4096, 8, 128
    heads = 32 // 2  # a TP rank's
    for cp in (2, 4, 8):
        for comm in ("allgather", "p2p"):
            config = at(cp, comm)
            split = memory_breakdown(config, "selective", vocab_size=vocab)
            attention = context_parallel_attention_per_layer(config)
            working = context_parallel_attention_working(config)
            # per token exactly 1/cp; the layer whose attention is recomputed keeps it once,
            # and holds what its attention holds while it runs
            assert split["activations"] - attention - working == pytest.approx(
                one["activations"] / cp
            )
            for part in ("weights", "gradients", "optimizer_state"):
                assert split[part] == one[part]
            per_token = activations_per_layer(config, "selective")
            assert per_token == pytest.approx(activations_per_layer(at(1), "selective") / cp)
            assert activations_per_layer(config, "none") == pytest.approx(per_token + attention)
            local = s // cp
            if comm == "allgather":
                # the other ranks' K/V (of this TP rank's 4 groups); one additive mask for
                # every sequence and head (16 bits); the kernel's fp32 log-sum-exp and output
                others = 2 * 2 * b * (s - local) * groups // 2 * d
                kernel = 4 * heads * local * b + 2 * heads * d * local * b
                assert attention == pytest.approx(others + 2 * local * s + kernel)
                assert working == local * s  # the boolean mask the additive one is made of
            else:
                # the fused ring keeps what flash keeps: its fp32 log-sum-exp (q, k, v and the
                # output are per-token tensors); in its backward it holds two K/V blocks in
                # flight and their two fp32 gradient accumulators, the fp32 query gradient,
                # the late query chunk's copies of three tensors, and one call's gradients
                block = 2 * b * local * groups // 2 * d  # a block's K and V elements
                width = heads * d * local * b
                assert attention == 4 * heads * local * b
                assert working == pytest.approx(
                    2 * 2 * block + 2 * 4 * block + 4 * width + 3 * width + 2 * (width + block)
                )
                # With packed documents the ring is float32 torch ops: the whole K/V in fp32,
                # q's fp32 copy, each block's fp32 scores and probabilities and its masks (one
                # a sequence), the merge's fp32 outputs of every block and their
                # log-sum-exps and weights; three fp32 tensors of one block's scores during
                # its backward
                two = 2
                ring = at(cp, comm, f"training.micro_batch_size={two}",
                          "data.reset_attention_mask=true")  # fmt: skip
                kv = 4 * 2 * two * s * groups // 2 * d
                scores = 8 * heads * local * s * two + two * local * s
                merge = 4 * (heads * d + 3 * heads) * s * two
                assert context_parallel_attention_per_layer(ring) == pytest.approx(
                    kv + 4 * local * two * h / 2 + scores + merge
                )
                assert context_parallel_attention_working(ring) == (
                    3 * 4 * heads * local * (s // cp) * two
                )
                continue
            # With documents (data.reset_attention_mask) every sequence has its own mask.
            two = at(cp, comm, "training.micro_batch_size=2")
            documents = at(
                cp, comm, "training.micro_batch_size=2", "data.reset_attention_mask=true"
            )
            assert context_parallel_attention_per_layer(
                documents
            ) - context_parallel_attention_per_layer(two) == pytest.approx(2 * local * s)
        # With the all-gather the whole falls as ~1/cp: the attention's masks are a few %.
        ratio = (
            memory_breakdown(at(cp), "selective", vocab_size=vocab)["activations"]
            / (one["activations"])
        )
        assert 1 / cp < ratio < 1.1 / cp
    # The distributed optimizer shards over dp x cp: dp 2 x cp 4 as dp 8.
    sharded = at(4, "allgather", "parallel.use_distributed_optimizer=true")
    flat = at(1, "allgather", "parallel.use_distributed_optimizer=true")
    assert (
        memory_breakdown(sharded, vocab_size=vocab, data_parallel_size=2)["optimizer_state"]
        == memory_breakdown(flat, vocab_size=vocab, data_parallel_size=8)["optimizer_state"]
    )


def test_a_moe_layer_under_context_parallelism_holds_the_larger_transient(monkeypatch):
    """A MoE layer at cp 2 with selective recompute holds, one layer at a time, its all-to-all
    buffers (in its MLP's backward) and the attention being recomputed over the whole
    sequence (in its core's, later): the estimate adds the larger of the two, as it adds the
    one there is for a dense layer at cp 2 or a MoE layer at cp 1."""
    from megatrain.plan import memory
    from megatrain.plan.accounting import context_parallel_attention_per_layer as attention
    from megatrain.plan.accounting import moe_dispatch_bytes

    def at(cp: int, seq: int):
        return load_config(
            MODELS / "mixtral-8x7b.toml",
            [
                "parallel.tensor_model_parallel_size=2",
                "parallel.sequence_parallel=true",
                f"parallel.context_parallel_size={cp}",
                'parallel.cp_comm_type="allgather"',
                f"training.seq_length={seq}",
                f"model.max_position_embeddings={seq}",
            ],
        )

    for seq in (4096, 32768):  # the dispatch buffers the larger, then the attention
        config = at(2, seq)
        with_it = memory_breakdown(config, "selective", vocab_size=32000)["activations"]
        monkeypatch.setattr(memory, "context_parallel_attention_per_layer", lambda c: 0.0)
        without = memory_breakdown(config, "selective", vocab_size=32000)["activations"]
        monkeypatch.undo()
        larger = max(moe_dispatch_bytes(config), attention(config))
        assert with_it - without == pytest.approx(larger - moe_dispatch_bytes(config))
        assert attention(config) > 0
    assert attention(at(2, 32768)) > moe_dispatch_bytes(at(2, 32768))
    assert attention(at(2, 4096)) < moe_dispatch_bytes(at(2, 4096))


def _saved_elements(config, vocab: int) -> int:
    """Elements of the distinct tensors autograd saves in one training forward of `config`'s
    model (one microbatch, on this CPU), counted by storage."""
    import torch

    from megatrain.models import build_model_chunks
    from megatrain.parallelize import parallelize_model

    (chunk,) = parallelize_model(build_model_chunks("gpt", model_config(config, vocab), 1))
    chunk.train()
    t = config.training
    tokens = torch.randint(0, vocab, (t.micro_batch_size, t.seq_length))
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes() // (
            tensor.element_size()
        )
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        chunk(tokens, tokens)
    return sum(saved.values())


def test_no_dropout_masks_without_dropout(gloo_world_of_one):
    """What autograd saves for a GPT without hidden dropout (Llama's, MPT's) is what it saves
    with it less the masks: two a layer and the embedding's, s b h elements each, as
    activations_per_layer's 10 s b h (8 without masks) and memory's embedding mask count
    them (1 byte an element in 16 bits; fp32, as here, doubles every term)."""
    overrides = [
        "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.max_position_embeddings=32", "model.attention_dropout=0.0",
        "training.seq_length=32", "training.micro_batch_size=2",
    ]  # fmt: skip
    vocab = 128
    saved, planned = {}, {}
    for dropout in (0.1, 0.0):
        config = load_config(None, [*overrides, f"model.hidden_dropout={dropout}"])
        saved[dropout] = _saved_elements(config, vocab)
        planned[dropout] = memory_breakdown(config, "none", vocab_size=vocab)["activations"]
    s, b, h, layers = 32, 2, 64, 2
    masks = (2 * layers + 1) * s * b * h
    assert saved[0.1] - saved[0.0] == masks
    assert planned[0.1] - planned[0.0] == 2 * masks  # fp32: twice the 16-bit bytes
