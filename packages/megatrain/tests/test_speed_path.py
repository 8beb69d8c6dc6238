"""The model's speed path (issue 17): fused bias ops, per-layer torch.compile, flash-eligible SDPA.

Each part is switchable and held equal to the plain path on the CPU in fp32: the fused
structure (the linears' `skip_bias_add`, `bias_gelu`, `bias_dropout_add`) against the math as
written out before it, `training.compile` against eager, with dropout off and on (the same
seed must draw the same masks), and under activation recompute.  One process (a gloo world
of one), a 2-layer model: torch.compile takes seconds per graph on a CPU; and once at tp 2
with sequence parallelism, where the collectives sit inside the compiled graph.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megacore import parallel_state as ps
from megacore import tensor_parallel as tp
from megacore.testing import run_distributed
from megatrain.config import ConfigError, load_config
from megatrain.models.gpt import GPTConfig, GPTModel, build_gpt_chunks
from megatrain.parallelize import apply_compile, apply_recompute, parallelize_model

B, S, VOCAB = 2, 16, 64


def _cfg(dropout: float, recompute: str = "none") -> GPTConfig:
    return GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=S,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        recompute=recompute,
    )


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    return tokens, labels


def _plain_losses(model: GPTModel, tokens, labels) -> torch.Tensor:
    """The model's math as written before the fused structure: each linear adds its bias,
    then GeLU, or dropout and the residual; the random draws in the model's order."""
    cfg = model.config
    p = cfg.hidden_dropout
    x = model.embed(tokens)
    for layer in model.layers.values():
        att, mlp = layer.attention, layer.mlp
        qkv = F.linear(layer.ln1(x), att.qkv.weight, att.qkv.bias)
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, att.heads_local, 3, att.head_dim).permute(3, 1, 2, 0, 4)
        # One TP rank: the default stream draws the attention dropout (no tracker fork).
        core = F.scaled_dot_product_attention(
            q, k, v, dropout_p=cfg.attention_dropout, is_causal=True
        )
        core = core.permute(2, 0, 1, 3).reshape(s, b, -1)
        x = x + F.dropout(F.linear(core, att.proj.weight, att.proj.bias), p, p > 0)
        hidden = F.gelu(F.linear(layer.ln2(x), mlp.fc1.weight, mlp.fc1.bias), approximate="tanh")
        x = x + F.dropout(F.linear(hidden, mlp.fc2.weight, mlp.fc2.bias), p, p > 0)
    logits = F.linear(model.final_layernorm(x), model.embedding.weight)
    losses = F.cross_entropy(logits.flatten(0, 1), labels.t().flatten(), reduction="none")
    return losses.view(s, b).t()


def _step(model: GPTModel, forward=None, seed: int = 42):
    """Per-token losses and gradients of one forward and backward from `seed`."""
    model.train()
    model.zero_grad()
    tp.model_parallel_manual_seed(seed)
    tokens, labels = _batch()
    losses = (forward or model)(tokens, labels)
    losses.mean().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(a, b, atol):
    losses_a, grads_a = a
    losses_b, grads_b = b
    torch.testing.assert_close(losses_a, losses_b, rtol=0, atol=atol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fused_bias_structure_is_the_plain_math(gloo_world_of_one, dropout, recompute):
    model = apply_recompute(GPTModel(_cfg(dropout, recompute), seed=1234, device="cpu"), recompute)
    layer = model.layers["0"]
    assert layer.mlp.fc1.skip_bias_add and layer.mlp.fc2.skip_bias_add
    assert layer.attention.proj.skip_bias_add
    plain = _step(model, lambda t, lab: _plain_losses(model, t, lab))
    fused = _step(model)
    assert plain[0].std() > 0  # dropout on: the draws matched, not just the shapes
    # The biases now join after the matmul instead of inside it (addmm): rounding only.
    _assert_same(fused, plain, atol=1e-6)


@pytest.mark.filterwarnings("ignore:.*torch.jit:DeprecationWarning")  # inductor's own
def test_compile_equals_eager(gloo_world_of_one):
    """training.compile: the compiled layers give eager's losses and gradients, with dropout
    (the same masks from the same seed) and without, under full recompute (checkpoint around
    the compiled layer) and none; one graph serves both layers (no recompile per layer)."""
    torch._dynamo.reset()
    cfg = _cfg(0.1)
    eager = GPTModel(cfg, seed=1234, device="cpu")
    compiled = apply_compile(GPTModel(cfg, seed=1234, device="cpu"))
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            _assert_same(_step(compiled), _step(eager), atol=1e-5)
        assert torch._dynamo.utils.counters["frames"]["ok"] > frames  # it did compile
        for dropout, recompute in ((0.1, "full"), (0.0, "none")):
            # The config object is shared: the models read the dropout at each forward.
            cfg.hidden_dropout = cfg.attention_dropout = dropout
            apply_recompute(compiled, recompute)
            apply_recompute(eager, recompute)
            _assert_same(_step(compiled), _step(eager), atol=1e-5)
    finally:
        torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:.*torch.jit:DeprecationWarning")
def test_compiled_layer_is_one_graph_with_dropout_at_one_tp_rank(gloo_world_of_one):
    """At tp 1 the attention dropout draws from the default stream (no generator swap, which
    dynamo cannot trace): a training layer with dropout compiles to one graph, no break."""
    torch._dynamo.reset()
    tp.model_parallel_manual_seed(0)  # the tracker a tp > 1 layer would fork
    try:
        for dropout in (0.1, 0.0):
            (model,) = build_gpt_chunks(_cfg(dropout), 1234, device="cpu")
            layer = model.layers["0"]
            x = torch.randn(S, B, 32, requires_grad=True)
            explained = torch._dynamo.explain(layer)(x)
            assert explained.graph_count == 1 and explained.graph_break_count == 0, (
                dropout,
                [str(b.reason)[:200] for b in explained.break_reasons],
            )
    finally:
        torch._dynamo.reset()


def _tp2_step(cfg, model, seed: int = 5):
    """Loss and gradients of one forward and backward of `model` (DDP-wrapped or not) from
    `seed`, as plain numbers (tensors would travel as shared memory of a rank that exits)."""
    tp.model_parallel_manual_seed(seed)
    tokens, labels = _batch()
    loss = model(tokens, labels).mean()
    loss.backward()
    module = getattr(model, "module", model)
    grads = {n: getattr(p, "main_grad", p.grad).clone() for n, p in module.named_parameters()}
    return loss.item(), grads


def _at_tp2_with_sequence_parallelism():
    """tp 2 with sequence parallelism and dropout, where every draw in a layer is per rank:
    the layers run inside one fork each (`LanguageModel.in_rank_stream`), so

    - the masks are those of a fork per draw (the forks inside a layer, before): equal steps
      with the outer fork removed, under full and selective recompute (a checkpoint taken
      inside the fork recomputes inside it);
    - training.compile traces each layer whole: no graph break, the same steps as eager
      (the TP collectives and nccl_semantics' wrappers inside the compiled graph);
    - CUDA graphs (emulated) take the same steps.
    """
    import torch._dynamo

    from megacore.distributed import DistributedDataParallel
    from megatrain import parallelize
    from megatrain.testing import cuda_graphs_on_cpu

    ps.initialize_model_parallel(2, 1)
    cfg = GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=S,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        recompute="full",
        sequence_parallel=True,
    )

    def built(c):
        return parallelize_model(build_gpt_chunks(c, 1234, device="cpu"))[0]

    def per_draw(model):  # the forks inside the layer swap each time: no outer fork
        model.in_rank_stream = lambda layer: layer
        return model

    out = {}
    for recompute in ("full", "selective"):
        c = dataclasses.replace(cfg, recompute=recompute)
        out[f"{recompute}-eager"] = _tp2_step(c, built(c))
        out[f"{recompute}-per-draw"] = _tp2_step(c, per_draw(built(c)))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        out["full-compiled"] = _tp2_step(cfg, apply_compile(built(cfg)))
        breaks = dict(torch._dynamo.utils.counters["graph_break"])
        compiled_frames = torch._dynamo.utils.counters["frames"]["ok"]
    finally:
        torch._dynamo.reset()
    plain = dataclasses.replace(cfg, recompute="none")

    def ddp(model):
        return DistributedDataParallel(model, gradient_accumulation_fusion=True)

    out["none-eager"] = _tp2_step(plain, ddp(built(plain)))
    with cuda_graphs_on_cpu():
        graphed = parallelize.apply_cuda_graphs(ddp(built(plain)), S, B, torch.float32)
    out["none-graphs"] = _tp2_step(plain, graphed)
    quiet = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)
    out["full-no-dropout"] = _tp2_step(quiet, built(quiet))
    ps.destroy_model_parallel()
    pairs = [
        ("full-eager", "full-per-draw"),
        ("selective-eager", "selective-per-draw"),
        ("full-eager", "full-compiled"),
        ("none-eager", "none-graphs"),
    ]
    losses = {name: loss for name, (loss, _) in out.items()}
    diffs = {
        (a, b): max((out[a][1][n] - out[b][1][n]).abs().max().item() for n in out[a][1])
        for a, b in pairs
    }
    return losses, diffs, breaks, compiled_frames


def test_at_tp2_with_sequence_parallelism_a_layer_draws_in_one_fork():
    for losses, diffs, breaks, frames in run_distributed(
        _at_tp2_with_sequence_parallelism, 2, timeout=300
    ):
        assert losses["full-eager"] != losses["full-no-dropout"]  # the dropout is on
        for a, b in diffs:
            assert losses[a] == pytest.approx(losses[b], abs=1e-6), (a, b, losses)
        # The same masks as a fork per draw, bitwise; CUDA graphs (emulated) bitwise too.
        assert diffs[("full-eager", "full-per-draw")] == 0.0, diffs
        assert diffs[("selective-eager", "selective-per-draw")] == 0.0, diffs
        assert diffs[("none-eager", "none-graphs")] == 0.0, diffs
        assert diffs[("full-eager", "full-compiled")] < 1e-6, diffs
        assert frames > 0 and not breaks, breaks  # it compiled, each layer whole


def test_training_compile_is_a_checked_boolean():
    assert load_config(None).training.compile is False
    assert load_config(None, ["training.compile=true"]).training.compile is True
    with pytest.raises(ConfigError, match=r"training\.compile: expected bool"):
        load_config(None, ["training.compile=1"])


def test_training_attention_is_the_flash_eligible_call(gloo_world_of_one, monkeypatch):
    """Flash attention (bf16/fp16 on CUDA) takes no attn_mask, 4-D [b, heads, s, d] inputs,
    head_dim <= 256 and a last dimension of stride 1: what training passes, recompute or not."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        calls.append((q, k, v, args, kwargs))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    for recompute in ("none", "selective"):
        calls.clear()
        _step(apply_recompute(GPTModel(_cfg(0.1, recompute), seed=1234, device="cpu"), recompute))
        assert calls  # selective: the forward and its recompute in backward
        for q, k, v, args, kwargs in calls:
            assert not args and kwargs.get("attn_mask") is None and kwargs["is_causal"]
            assert kwargs["dropout_p"] == 0.1
            for t in (q, k, v):
                assert t.shape == (B, 4, S, 8) and t.stride(-1) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention needs a CUDA GPU")
def test_flash_attention_runs_the_training_forward(gloo_world_of_one):
    """With SDPA held to the flash kernel (an error if the call were not eligible), a bf16
    model trains a step on the GPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = GPTModel(_cfg(0.1), seed=1234, device="cuda", dtype=torch.bfloat16)
    model.train()
    tp.model_parallel_manual_seed(42)
    tokens, labels = (t.cuda() for t in _batch())
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        losses = model(tokens, labels)
        losses.mean().backward()
    assert torch.isfinite(losses).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
