"""Tensor parallelism equals one process: megacore's tiny stack at TP=1, 2, 4 on gloo."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_stack import Block, TinyConfig, TinyStack, full_tensor

from megacore import parallel_state as ps
from megacore import tensor_parallel as tp
from megacore.testing import count_tp_collectives, run_distributed

SEQ, BATCH = 8, 2


def _batch(cfg):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _run_model(cfg):
    """Loss, full logits, full weights and full gradients of TinyStack at the current TP size."""
    tp.model_parallel_manual_seed(1234)
    model = TinyStack(cfg)
    tokens, targets = _batch(cfg)
    loss = model(tokens, targets)
    loss.backward()
    tp.sync_sequence_parallel_grads(model)
    with torch.no_grad():
        # The output layer gathers the sequence itself; gather the vocabulary slices here.
        logits = model.logits(tokens).transpose(0, -1)
        logits = full_tensor(model.embedding.weight, logits).transpose(0, -1)
    params = dict(model.named_parameters())
    # Replicated parameters must get the same gradient on every TP rank.
    replicated_agree = True
    for p in params.values():
        if not getattr(p, "tensor_model_parallel", False):
            copies = [
                torch.empty_like(p.grad) for _ in range(ps.get_tensor_model_parallel_world_size())
            ]
            dist.all_gather(copies, p.grad, group=ps.get_tensor_model_parallel_group())
            replicated_agree &= all(torch.equal(c, p.grad) for c in copies)
    return {
        "loss": loss.detach(),
        "logits": logits,
        "weights": {n: full_tensor(p) for n, p in params.items()},
        "grads": {n: full_tensor(p, p.grad) for n, p in params.items()},
        "replicated_agree": replicated_agree,
    }


def _run_gathered_mlp():
    """Column-parallel with gather_output, then row-parallel splitting its own input."""
    tp.model_parallel_manual_seed(5)
    fc1 = tp.ColumnParallelLinear(12, 16, gather_output=True)
    fc2 = tp.RowParallelLinear(16, 12, input_is_parallel=False, skip_bias_add=True)
    with torch.no_grad():
        fc1.bias.copy_(tp.shard_of(torch.linspace(-1, 1, 16), 0, *_tp_rank_and_size()))
        fc2.bias.fill_(0.5)
    x = torch.randn(5, 3, 12, generator=torch.Generator().manual_seed(9), requires_grad=True)
    hidden, no_bias = fc1(x)
    out, bias = fc2(torch.tanh(hidden))
    y = out + bias
    (y * torch.arange(12.0)).sum().backward()
    layers = {"fc1": fc1, "fc2": fc2}
    return {
        "y": y.detach(),
        "x_grad": x.grad,
        "returned_bias": no_bias is None and bias is fc2.bias,
        "grads": {
            f"{name}.{n}": full_tensor(p, p.grad)
            for name, layer in layers.items()
            for n, p in layer.named_parameters()
        },
    }


def _tp_rank_and_size():
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _count_block_collectives(cfg):
    """Collectives issued by a stack of blocks in one forward + backward, by kind."""
    tp.model_parallel_manual_seed(1234)
    blocks = torch.nn.Sequential(*(Block(cfg) for _ in range(cfg.layers)))
    x = torch.randn(SEQ, BATCH, cfg.hidden, generator=torch.Generator().manual_seed(3))
    if cfg.sequence_parallel:
        x = tp.scatter_to_sequence_parallel_region(x)
    x.requires_grad_(True)
    with count_tp_collectives() as counts:
        blocks(x).sum().backward()
    return counts


def _max_diff(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max(_max_diff(a[k], b[k]) for k in a)
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _error_of(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except ValueError as e:
        return str(e)
    return None


def _stack_at_each_tp():
    out = {}
    for sp in (False, True):
        cfg = TinyConfig(sequence_parallel=sp)
        results = {}
        for size in (1, 2, 4):
            ps.initialize_model_parallel(tensor_model_parallel_size=size)
            results[size] = _run_model(cfg)
            results[size]["mlp"] = _run_gathered_mlp()
            out[("counts", sp, size)] = _count_block_collectives(cfg)
            if size == 4:
                out["errors"] = {
                    "column": _error_of(tp.ColumnParallelLinear, 32, 30),
                    "row": _error_of(tp.RowParallelLinear, 30, 32),
                    "vocab": _error_of(tp.VocabParallelEmbedding, 62, 8),
                    "heads": _error_of(tp.divide_by_tp, 6, "num_attention_heads"),
                    "ffn": _error_of(Block, TinyConfig(ffn=66)),
                    "sequence": _error_of(
                        tp.scatter_to_sequence_parallel_region, torch.zeros(6, 1, 4)
                    ),
                }
            ps.destroy_model_parallel()
        ref = results[1]
        for size in (2, 4):
            got = results[size]
            out[("loss", sp, size)] = _max_diff(got["loss"], ref["loss"])
            out[("logits", sp, size)] = _max_diff(got["logits"], ref["logits"])
            out[("grads", sp, size)] = _max_diff(got["grads"], ref["grads"])
            out[("weights_equal", sp, size)] = all(
                torch.equal(got["weights"][n], ref["weights"][n]) for n in ref["weights"]
            )
            out[("replicated_agree", sp, size)] = got["replicated_agree"]
            out[("mlp", sp, size)] = _max_diff(
                {k: got["mlp"][k] for k in ("y", "x_grad", "grads")},
                {k: ref["mlp"][k] for k in ("y", "x_grad", "grads")},
            )
            out[("mlp_bias", sp, size)] = got["mlp"]["returned_bias"]
        out[("loss_value", sp)] = ref["loss"].item()
        out[("grad_norm", sp)] = sum(g.norm() ** 2 for g in ref["grads"].values()).sqrt().item()
    return out


def test_tiny_stack_equal_at_tp_1_2_4_with_and_without_sequence_parallel():
    results = run_distributed(_stack_at_each_tp, world_size=4, timeout=300)
    for rank, out in enumerate(results):
        for sp in (False, True):
            # Loss ~ log(64) and non-trivial gradients: the comparison is not between zeros.
            assert 3.5 < out[("loss_value", sp)] < 5.0
            assert out[("grad_norm", sp)] > 0.1
            for size in (2, 4):
                where = f"rank {rank}, sequence_parallel={sp}, tp={size}"
                assert out[("weights_equal", sp, size)], where
                assert out[("replicated_agree", sp, size)], where
                assert out[("loss", sp, size)] < 1e-5, where
                assert out[("logits", sp, size)] < 1e-5, where
                assert out[("grads", sp, size)] < 1e-5, where
                assert out[("mlp", sp, size)] < 1e-5, where
                assert out[("mlp_bias", sp, size)], where
        layers = TinyConfig().layers
        # Paper Fig. 4: f and g, one all-reduce forward and one backward per column/row pair.
        assert out[("counts", False, 1)] == dict.fromkeys(out[("counts", False, 1)], 0)
        for size in (2, 4):
            assert out[("counts", False, size)] == {
                "all_reduce": 2 * layers,
                "all_gather": 0,
                "reduce_scatter": 0,
                "wrong_group": 0,
            }
            # Sequence parallelism trades each all-reduce for an all-gather + reduce-scatter.
            assert out[("counts", True, size)] == {
                "all_reduce": 0,
                "all_gather": 2 * layers,
                "reduce_scatter": 2 * layers,
                "wrong_group": 0,
            }
        errors = out["errors"]
        assert "output_size (30)" in errors["column"] and "(4 x 1)" in errors["column"]
        assert "input_size (30)" in errors["row"]
        assert (
            "num_embeddings (62)" in errors["vocab"]
            and "vocab_size_with_padding" in errors["vocab"]
        )
        assert (
            errors["heads"]
            == "num_attention_heads (6) is not divisible by tensor_model_parallel_size (4)"
        )
        assert (
            errors["ffn"]
            == "ffn_hidden_size (66) is not divisible by tensor_model_parallel_size (4)"
        )
        assert "sequence length 6" in errors["sequence"]


def _cross_entropy_at(size):
    ps.initialize_model_parallel(tensor_model_parallel_size=size)
    rank = ps.get_tensor_model_parallel_rank()
    vocab = tp.vocab_size_with_padding(37, size, multiple=5)  # 40: the last ids are padding
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 3, vocab, generator=g, dtype=torch.float64).float() * 4
    logits[0] += 1e4  # huge logits: a naive exp would overflow
    logits[1, 0, 5] = 3e4
    targets = torch.randint(0, 37, (6, 3), generator=g)
    # A target in every shard, including each shard's first and last id.
    per = vocab // size
    firsts_lasts = [i for r in range(size) for i in (r * per, r * per + per - 1)]
    targets.view(-1)[: len(firsts_lasts)] = torch.tensor(firsts_lasts)
    weights = torch.rand(6, 3, generator=g)

    full = logits.clone().requires_grad_(True)
    expected = F.cross_entropy(full.view(-1, vocab), targets.view(-1), reduction="none").view(6, 3)
    (expected * weights).sum().backward()

    local = logits[..., rank * per : (rank + 1) * per].clone().requires_grad_(True)
    loss = tp.vocab_parallel_cross_entropy(local, targets)
    (loss * weights).sum().backward()

    low = logits.to(torch.bfloat16)[..., rank * per : (rank + 1) * per].requires_grad_(True)
    tp.vocab_parallel_cross_entropy(low, targets).sum().backward()
    out = {
        "loss": (loss - expected).abs().max().item(),
        "grad": (local.grad - full.grad[..., rank * per : (rank + 1) * per]).abs().max().item(),
        "finite": bool(torch.isfinite(loss).all()),
        "bf16": (str(low.grad.dtype), tp.vocab_parallel_cross_entropy(low, targets).dtype),
    }
    ps.destroy_model_parallel()
    return out


def _linear_cross_entropy_at(size):
    """The fused output layer + mean loss against F.linear and F.cross_entropy on the full
    vocabulary: padding ids, several chunks and a partial one, an upstream gradient other
    than 1, huge logits; and without grad mode, the loss alone."""
    ps.initialize_model_parallel(tensor_model_parallel_size=size)
    rank = ps.get_tensor_model_parallel_rank()
    true_vocab, h = 37, 8
    vocab = tp.vocab_size_with_padding(true_vocab, size, multiple=5)
    per = vocab // size
    g = torch.Generator().manual_seed(12)
    x = torch.randn(6, 3, h, generator=g)
    x[0, 0] *= 500  # logits in the thousands: a naive exp would overflow
    weight = torch.randn(vocab, h, generator=g)
    targets = torch.randint(0, true_vocab, (6, 3), generator=g)
    targets.view(-1)[:size] = torch.arange(size) * per  # a target in every shard
    upstream = 2.5  # e.g. a loss scale over the number of microbatches

    full_x, full_w = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logits = F.linear(full_x, full_w)
    logits = logits.masked_fill(torch.arange(vocab) >= true_vocab, float("-inf"))
    expected = F.cross_entropy(logits.view(-1, vocab), targets.view(-1))
    (expected * upstream).backward()

    mine = weight[rank * per : (rank + 1) * per].clone().requires_grad_(True)
    mine_x = x.clone().requires_grad_(True)
    loss = tp.linear_vocab_parallel_cross_entropy(
        tp.copy_to_tensor_model_parallel_region(mine_x),
        mine,
        targets,
        true_vocab_size=true_vocab,
        chunk_tokens=4,  # 18 tokens: chunks of 4, 4, 4, 4 and 2
    )
    (loss * upstream).backward()
    with torch.no_grad():  # evaluation: the same loss, in chunks of other sizes
        no_grad = tp.linear_vocab_parallel_cross_entropy(
            mine_x, mine, targets, true_vocab_size=true_vocab, chunk_tokens=7
        )

    # bf16 against the unfused bf16 path (the logits made in bf16, the loss in fp32).
    low_w = mine.detach().to(torch.bfloat16).requires_grad_(True)
    low_x = x.to(torch.bfloat16).requires_grad_(True)
    fused = tp.linear_vocab_parallel_cross_entropy(
        tp.copy_to_tensor_model_parallel_region(low_x), low_w, targets,
        true_vocab_size=true_vocab, chunk_tokens=4,
    )  # fmt: skip
    (fused * upstream).backward()
    ref_w = low_w.detach().clone().requires_grad_(True)
    ref_x = low_x.detach().clone().requires_grad_(True)
    ref_logits = F.linear(tp.copy_to_tensor_model_parallel_region(ref_x), ref_w)
    padding = torch.arange(rank * per, (rank + 1) * per) >= true_vocab
    ref_logits = ref_logits.masked_fill(padding, float("-inf"))
    ref = tp.vocab_parallel_cross_entropy(ref_logits.float(), targets).mean()
    (ref * upstream).backward()
    out = {
        "shape": tuple(loss.shape),
        "loss": (loss - expected).abs().item(),
        "no_grad": (no_grad - expected).abs().item(),
        "grad_x": ((mine_x.grad - full_x.grad).abs().max() / full_x.grad.abs().max()).item(),
        "grad_w": (
            (mine.grad - full_w.grad[rank * per : (rank + 1) * per]).abs().max()
            / full_w.grad.abs().max()
        ).item(),
        "padding_grad_zero": bool((mine.grad[padding] == 0).all()),
        "bf16": (str(fused.dtype), str(low_w.grad.dtype), str(low_x.grad.dtype)),
        "bf16_loss": (fused - ref).abs().item(),
        "bf16_grad_w": ((low_w.grad - ref_w.grad).abs().max() / ref_w.grad.abs().max()).item(),
        "bf16_grad_x": ((low_x.grad - ref_x.grad).abs().max() / ref_x.grad.abs().max()).item(),
    }
    ps.destroy_model_parallel()
    return out


def _strided_init_at_tp2():
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(5)
    layer = tp.ColumnParallelLinear(8, 12, stride=3)  # [q; k; v] stacked, each split over TP
    torch.manual_seed(5)
    master = torch.empty(12, 8).normal_(0, 0.02)
    shards = [torch.empty_like(layer.weight) for _ in range(2)]
    dist.all_gather(shards, layer.weight.detach(), group=ps.get_tensor_model_parallel_group())
    rank = ps.get_tensor_model_parallel_rank()
    q, k, v = master.chunk(3)
    mine = torch.cat([part.chunk(2)[rank] for part in (q, k, v)])
    ps.destroy_model_parallel()
    return torch.equal(tp.unshard(shards, 0, 3), master) and torch.equal(layer.weight, mine)


def _masks(shape, inside):
    ones = torch.ones(shape)
    if inside:
        with tp.get_rng_tracker().fork():
            return F.dropout(ones, 0.5) > 0
    return F.dropout(ones, 0.5) > 0


def _rng_streams_at_tp2():
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    group = ps.get_tensor_model_parallel_group()

    def gathered(mask):
        copies = [torch.empty_like(mask) for _ in range(2)]
        dist.all_gather(copies, mask, group=group)
        return copies

    tp.model_parallel_manual_seed(99)
    outside = gathered(_masks((64,), inside=False))
    inside = gathered(_masks((64,), inside=True))
    after_fork = _masks((64,), inside=False)
    tp.model_parallel_manual_seed(99)
    _masks((64,), inside=False)
    without_fork = _masks((64,), inside=False)
    # A fork inside a fork of the same state changes nothing: the draws go on in order.
    tracker = tp.get_rng_tracker()
    tp.model_parallel_manual_seed(5)
    with tracker.fork():
        flat = (torch.rand(4), torch.rand(4))
    tp.model_parallel_manual_seed(5)
    with tracker.fork():
        first = torch.rand(4)
        with tracker.fork():
            nested = (first, torch.rand(4))
    # A checkpoint taken inside a fork, after draws there, recomputes inside it: the backward
    # draws the mask the forward drew (not the tracker's state from before the fork).
    x = torch.ones(64, requires_grad=True)
    with tracker.fork():
        torch.rand(8)
        y = tp.checkpoint(lambda t: _dropout_in_fork(t), False, x)
    y.sum().backward()
    ps.destroy_model_parallel()
    return {
        "outside_same": torch.equal(outside[0], outside[1]),
        "inside_differ": not torch.equal(inside[0], inside[1]),
        "fork_leaves_default_stream": torch.equal(after_fork, without_fork),
        "nested_fork_goes_on": all(map(torch.equal, flat, nested)),
        "recompute_in_the_fork": torch.equal(x.grad, y.detach()),
    }


def _dropout_in_fork(t):
    with tp.get_rng_tracker().fork():
        return F.dropout(t, 0.5)


def _checkpoint_bitwise_at_tp2():
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = TinyConfig(dropout=0.2, layers=3)
    tp.model_parallel_manual_seed(1)
    model = TinyStack(cfg)
    tokens, targets = _batch(cfg)

    def run(recompute, distribute, seed=2024):
        model.zero_grad(set_to_none=True)
        cfg.recompute, cfg.distribute_saved_activations = recompute, distribute
        tp.model_parallel_manual_seed(seed)
        loss = model(tokens, targets)
        loss.backward()
        next_draw = torch.rand(4)  # the stream training goes on with after this step
        with tp.get_rng_tracker().fork():
            next_tracked = torch.rand(4)
        grads = [p.grad.clone() for p in model.parameters()]
        return loss.detach(), grads, next_draw, next_tracked

    plain = run(False, False)
    out = {"other_seed_changes_loss": not torch.equal(run(False, False, seed=7)[0], plain[0])}
    model.eval()
    out["dropout_matters"] = not torch.equal(model(tokens, targets).detach(), plain[0])
    model.train()
    for name, recompute, distribute in (("checkpointed", True, False), ("distributed", True, True)):
        loss, grads, draw, tracked = run(recompute, distribute)
        out[name] = {
            "loss": torch.equal(loss, plain[0]),
            "grads": all(torch.equal(a, b) for a, b in zip(grads, plain[1], strict=True)),
            "rng_after": torch.equal(draw, plain[2]) and torch.equal(tracked, plain[3]),
        }
    ps.destroy_model_parallel()
    return out


def _cross_entropy_rng_and_checkpoint():
    return {
        "ce": {size: _cross_entropy_at(size) for size in (1, 2, 4)},
        "linear_ce": {size: _linear_cross_entropy_at(size) for size in (1, 2, 4)},
        "strided_init": _strided_init_at_tp2(),
        "rng": _rng_streams_at_tp2(),
        "checkpoint": _checkpoint_bitwise_at_tp2(),
    }


def test_cross_entropy_rng_and_checkpointing():
    results = run_distributed(_cross_entropy_rng_and_checkpoint, world_size=4, timeout=300)
    for out in results:
        for size, ce in out["ce"].items():
            assert ce["finite"], size
            assert ce["loss"] < 1e-4, (size, ce)  # fp32 against float32 F.cross_entropy
            assert ce["grad"] < 1e-6, (size, ce)
            assert ce["bf16"] == ("torch.bfloat16", torch.float32)
        for size, ce in out["linear_ce"].items():
            # fp32 rounding of a loss and gradients of size ~100 (the scaled token); the
            # gradients relative to their largest entry.
            assert ce["shape"] == (), (size, ce)
            assert ce["loss"] < 2e-5 and ce["no_grad"] < 2e-5, (size, ce)
            assert ce["grad_x"] < 2e-6 and ce["grad_w"] < 2e-6, (size, ce)
            assert ce["bf16_loss"] < 1e-5, (size, ce)
            assert ce["padding_grad_zero"], size
            assert ce["bf16"] == ("torch.float32", "torch.bfloat16", "torch.bfloat16"), size
            # bf16: the chunks' weight gradients summed in fp32, then rounded once, as one GEMM
            # does; the two roundings may part by one bf16 step (2^-8 = 3.9e-3) at most.
            assert ce["bf16_grad_w"] < 8e-3 and ce["bf16_grad_x"] < 8e-3, (size, ce)
        assert out["strided_init"]
        assert out["rng"] == {
            "outside_same": True,
            "inside_differ": True,
            "fork_leaves_default_stream": True,
            "nested_fork_goes_on": True,
            "recompute_in_the_fork": True,
        }
        ckpt = out["checkpoint"]
        assert ckpt["other_seed_changes_loss"] and ckpt["dropout_matters"]
        for name in ("checkpointed", "distributed"):
            assert ckpt[name] == {"loss": True, "grads": True, "rng_after": True}, name


def test_gradient_accumulation_into_an_fp32_main_grad_from_bf16_operands():
    """The fused weight-gradient accumulation, bf16 GEMM operands into an fp32 main_grad: the
    CPU has no addmm(out_dtype=), so this is the GEMM-then-add fallback, remembered per device;
    same-dtype operands take one addmm_."""
    from megacore.tensor_parallel import weight_grad

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(8, 32, generator=g), torch.randn(32, 16, generator=g)
    start = torch.randn(8, 16, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        main_grad = start.clone()
        weight_grad.accumulate_gemm(main_grad, a.to(dtype), b.to(dtype))
        expected = start + (a.to(dtype) @ b.to(dtype)).float()
        assert main_grad.dtype == torch.float32
        torch.testing.assert_close(main_grad, expected, rtol=0, atol=1e-5)
    assert weight_grad._mixed_dtype_addmm == {"cpu": False}


def test_shard_helpers_round_trip():
    full = torch.arange(24.0).view(12, 2)
    for world in (1, 2, 4):
        for stride in (1, 3):
            shards = [tp.shard_of(full, 0, r, world, stride) for r in range(world)]
            assert torch.equal(tp.unshard(shards, 0, stride), full)
    # Stride 3 over [q; k; v]: rank 0 holds the first half of each block.
    assert tp.shard_of(full, 0, 0, 2, 3)[:, 0].tolist() == [0, 2, 8, 10, 16, 18]
    assert tp.vocab_size_with_padding(50257, 8) == 51200
    assert tp.vocab_size_with_padding(50257, 1) == 50304
    assert tp.vocab_range(64, 3, 4) == (48, 64)
    with pytest.raises(ValueError, match=r"vocabulary size \(10\) is not divisible by .* \(4\)"):
        tp.vocab_range(10, 0, 4)


def test_layers_refuse_use_before_initialization():
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(
        RuntimeError, match=r"get_tensor_model_parallel_world_size\(\) called before"
    ):
        tp.ColumnParallelLinear(4, 4)


def _overlap_operands(size, dtype):
    """A sequence of 4 chunks per rank and each rank's weight shards, the same on every rank
    for one seed (the output gradients too), in `dtype`, leaves that take gradients."""
    g = torch.Generator().manual_seed(11)
    seq, batch, hidden, cols = 4 * size, 3, 16, 24
    full_x = torch.randn(seq, batch, hidden, generator=g)
    column_w = torch.randn(cols, hidden, generator=g) / 4  # [cols / t, hidden] per rank
    row_x = torch.randn(seq, batch, cols, generator=g)  # [seq, batch, cols / t] per rank
    row_w = torch.randn(hidden, cols, generator=g) / 4
    column_grad = torch.randn(seq, batch, cols, generator=g)
    rank = ps.get_tensor_model_parallel_rank()
    mine = {
        "x": tp.shard_of(full_x, 0, rank, size),
        "column_w": tp.shard_of(column_w, 0, rank, size),
        "row_x": tp.shard_of(row_x, 2, rank, size),
        "row_w": tp.shard_of(row_w, 1, rank, size),
    }
    leaves = {k: v.to(dtype).requires_grad_(True) for k, v in mine.items()}
    grads = {
        "column": tp.shard_of(column_grad, 2, rank, size).to(dtype),
        # Each rank's own sequence chunk of the row-parallel output: its own draw.
        "row": torch.randn(seq // size, batch, hidden, generator=g.manual_seed(rank)).to(dtype),
    }
    return leaves, grads


def _overlap_results(size, dtype, overlap):
    """Outputs and gradients of the column- and row-parallel products, overlapped or as the
    plain collective + GEMM."""
    leaves, grads = _overlap_operands(size, dtype)
    if overlap:
        column = tp.all_gather_matmul(leaves["x"], leaves["column_w"])
        row = tp.matmul_reduce_scatter(leaves["row_x"], leaves["row_w"])
    else:
        gathered = tp.gather_from_sequence_parallel_region(leaves["x"])
        column = F.linear(gathered, leaves["column_w"])
        row = tp.reduce_scatter_to_sequence_parallel_region(
            F.linear(leaves["row_x"], leaves["row_w"])
        )
    torch.autograd.backward([column, row], [grads["column"], grads["row"]])
    out = {"column": column.detach(), "row": row.detach()}
    out.update({f"grad_{k}": v.grad for k, v in leaves.items()})
    return {k: v.float() for k, v in out.items()}


def _overlapped_layers(size, overlap, route):
    """A column- then row-parallel linear under sequence parallelism, their weight gradients
    by `route`: "autograd", "fused" (into main_grad) or "deferred" (split_backward)."""
    tp.model_parallel_manual_seed(3)
    kw = {"sequence_parallel": True, "tp_comm_overlap": overlap}
    fc1 = tp.ColumnParallelLinear(16, 32, **kw)
    fc2 = tp.RowParallelLinear(32, 16, input_is_parallel=True, **kw)
    written = []
    if route == "fused":
        for layer in (fc1, fc2):
            layer.weight.main_grad = torch.zeros_like(layer.weight)
            layer.weight.main_grad_written = written.append
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4 * size, 2, 16, generator=g)
    x = tp.scatter_to_sequence_parallel_region(x).requires_grad_(True)
    shifts, real_shift = [], dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: shifts.append(len(ops)) or real_shift(ops)
    try:
        split = tp.split_backward() if route == "deferred" else torch.enable_grad()
        with count_tp_collectives() as counts, split:
            y, _ = fc2(torch.tanh(fc1(x)[0]))
            with tp.deferring_weight_grads() as pending:
                (y * y).sum().backward()
    finally:
        dist.batch_isend_irecv = real_shift
    deferred = len(pending)
    tp.apply_weight_grads(pending)
    weight_grads = {
        name: full_tensor(layer.weight, getattr(layer.weight, "main_grad", layer.weight.grad))
        for name, layer in (("fc1", fc1), ("fc2", fc2))
    }
    return {
        "y": y.detach(),
        "x_grad": x.grad,
        "weight_grads": weight_grads,
        "bias_grads": {"fc1": fc1.bias.grad, "fc2": fc2.bias.grad},
        "written": len(written),
        "deferred": deferred,
        # The collectives issued, and the ring steps (each one send and one receive).
        "collectives": (counts["all_gather"], counts["reduce_scatter"], counts["all_reduce"]),
        "ring_steps": (len(shifts), set(shifts)),
    }


def _comm_overlap_at_tp_2_and_4():
    out = {}
    for size in (2, 4):
        ps.initialize_model_parallel(tensor_model_parallel_size=size)
        reference = _overlap_results(size, torch.float32, overlap=False)
        out[("fp32", size)] = _max_diff(_overlap_results(size, torch.float32, True), reference)
        out[("scale", size)] = min(v.abs().max().item() for v in reference.values())
        plain_bf16 = _overlap_results(size, torch.bfloat16, overlap=False)
        out[("bf16", size)] = _max_diff(_overlap_results(size, torch.bfloat16, True), reference)
        out[("bf16_plain", size)] = _max_diff(plain_bf16, reference)
        for route in ("autograd", "fused", "deferred"):
            plain = _overlapped_layers(size, False, route)
            got = _overlapped_layers(size, True, route)
            keys = ("y", "x_grad", "weight_grads", "bias_grads")
            out[("layers", route, size)] = _max_diff(
                {k: got[k] for k in keys}, {k: plain[k] for k in keys}
            )
            out[("routed", route, size)] = (got["written"], got["deferred"])
            out[("routed_plain", route, size)] = (plain["written"], plain["deferred"])
            out[("comm", route, size)] = (got["collectives"], got["ring_steps"])
            out[("comm_plain", route, size)] = (plain["collectives"], plain["ring_steps"])
        ps.destroy_model_parallel()
    return out


def test_comm_overlap_equals_the_collective_and_gemm_at_tp_2_and_4():
    """all_gather_matmul and matmul_reduce_scatter (rings of p2p steps overlapped with partial
    GEMMs) equal the plain all-gather + GEMM and GEMM + reduce-scatter, forward and every
    gradient, fp32 and bf16; the layers with tp_comm_overlap equal them without, with the
    weight gradients through autograd, into main_grad and deferred to the W step."""
    results = run_distributed(_comm_overlap_at_tp_2_and_4, world_size=4, timeout=300)
    for out in results:
        for size in (2, 4):
            assert out[("scale", size)] > 0.5  # no comparison between zeros
            # fp32: only the order of the sums differs.
            assert out[("fp32", size)] < 1e-5, (size, out[("fp32", size)])
            # bf16: within twice the plain bf16 path's own error against the fp32 reference.
            plain = out[("bf16_plain", size)]
            assert 0 < out[("bf16", size)] <= 2 * plain, (size, out[("bf16", size)], plain)
            for route in ("autograd", "fused", "deferred"):
                assert out[("layers", route, size)] < 1e-5, (route, size, out)
                # Both layers' weights went the same way, overlapped or not.
                expected = {"autograd": (0, 0), "fused": (2, 0), "deferred": (0, 2)}[route]
                assert out[("routed", route, size)] == expected, (route, size)
                assert out[("routed_plain", route, size)] == expected, (route, size)
                # Plain: fc1's all-gather and fc2's reduce-scatter, forward and backward.
                # Overlapped: none of them, four rings of t - 1 steps instead.
                assert out[("comm_plain", route, size)] == ((2, 2, 0), (0, set())), route
                assert out[("comm", route, size)] == ((0, 0, 0), (4 * (size - 1), {2})), route
