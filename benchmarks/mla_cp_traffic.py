"""Multi-latent attention's traffic under context parallelism, counted from the collectives.

One MLA layer (`megatrain.models.attention.multi_latent`) runs forward and backward at cp 2 in
gloo with each `cp_comm_type` ("allgather": the up-projected K and V gathered, V zero-padded
to the QK width; "latent": the normalized KV latent and the rotated rope key gathered, K/V
up-projected on each rank; "p2p": K/V blocks passed round a ring), while every collective's
tensors are counted: the all-gathers and reduce-scatters of megacore's sequence mappings
(`tensor_parallel.mappings._all_gather_flat`, `_reduce_scatter_flat`, module attributes for
this) and the ring's `batch_isend_irecv` receives.  Bytes received by one rank: an
all-gather's output less the rank's own part; a reduce-scatter's other ranks' contributions
to its part ((cp - 1) x the output); a receive's buffer.  Positions and documents sent with
K/V (int64) are counted apart (`meta`).

The hidden size does not enter what crosses ranks (only the latent and the heads do), so the
DeepSeek-V3 shape runs with a small hidden size and its attention's own sizes (128 heads,
kv_lora_rank 512, rope 64, no-rope 128, values 128) in bf16; each count is checked against
the per-token formula, which then gives the figures per layer at any sequence length.
"""

import contextlib

import torch

SHAPES = {
    # The tiny test model's attention (test_multi_latent_attention's MLA_LLAMA), fp32.
    "tiny": dict(
        hidden=32, heads=4, kv_lora_rank=8, nope=6, rope=4, v=5, q_lora_rank=12,
        dtype="float32", seq=64, batch=2,
    ),
    # DeepSeek-V3's attention (hidden 64 in place of 7168: it does not cross ranks), bf16.
    "deepseek-v3": dict(
        hidden=64, heads=128, kv_lora_rank=512, nope=128, rope=64, v=128, q_lora_rank=None,
        dtype="bfloat16", seq=256, batch=1,
    ),
}  # fmt: skip
COMMS = ("allgather", "latent", "p2p")


@contextlib.contextmanager
def counting():
    """Count the bytes this rank receives in megacore's gathers, reduce-scatters and ring
    receives; yields the running totals {"all_gather", "reduce_scatter", "p2p", "meta"}."""
    import torch.distributed as dist

    from megacore.tensor_parallel import mappings

    totals = {"all_gather": 0, "reduce_scatter": 0, "p2p": 0, "meta": 0}
    gather, scatter, batch = mappings._all_gather_flat, mappings._reduce_scatter_flat, None

    def _add(kind, t, numel):
        totals["meta" if not t.is_floating_point() else kind] += numel * t.element_size()

    def counted_gather(out, x, group=None):
        _add("all_gather", x, out.numel() - x.numel())
        return gather(out, x, group=group)

    def counted_scatter(out, x, group=None):
        _add("reduce_scatter", x, x.numel() - out.numel())
        return scatter(out, x, group=group)

    def counted_batch(ops):
        for op in ops:
            if op.op is dist.irecv:
                _add("p2p", op.tensor, op.tensor.numel())
        return batch(ops)

    batch = dist.batch_isend_irecv
    mappings._all_gather_flat, mappings._reduce_scatter_flat = counted_gather, counted_scatter
    dist.batch_isend_irecv = counted_batch
    try:
        yield totals
    finally:
        mappings._all_gather_flat, mappings._reduce_scatter_flat = gather, scatter
        dist.batch_isend_irecv = batch


def _config(shape: dict):
    from megatrain.models.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
        vocab_size=64, max_position_embeddings=shape["seq"], normalization="rmsnorm",
        position_embedding="rope", add_bias=False, attention_dropout=0.0,
        attention_type="mla", q_lora_rank=shape["q_lora_rank"],
        kv_lora_rank=shape["kv_lora_rank"], qk_head_dim=shape["nope"],
        qk_pos_emb_head_dim=shape["rope"], v_head_dim=shape["v"],
    )  # fmt: skip


def traffic_rank(shapes: dict) -> dict:
    """On each of 2 ranks: per shape and comm type, the bytes received in the layer's forward
    and backward (`counting`), and the output's checksum (equal across comm types)."""
    from megacore import parallel_state as ps
    from megatrain.models.attention.inputs import AttentionInputs
    from megatrain.models.attention.multi_latent import MultiLatentAttention
    from megatrain.models.common import cpu_generator, placement
    from megatrain.models.layout import ParallelContext
    from megatrain.parallelize.context_parallel import ContextParallel

    ps.initialize_model_parallel(1, 1, context_parallel_size=2)
    rank, size = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
    results = {}
    for name, shape in shapes.items():
        dtype = getattr(torch, shape["dtype"])
        cfg = _config(shape)
        local, b = shape["seq"] // size, shape["batch"]
        for comm in COMMS:
            module = MultiLatentAttention(
                cfg,
                placement(cpu_generator(1), "cpu", dtype),
                ParallelContext.from_process_groups(),
            )
            cp = ContextParallel(rank, size, comm, ps.get_context_parallel_group())
            module.context_parallel = cp
            positions = cp.positions(local, "cpu")
            inputs = AttentionInputs(position_ids=positions.expand(b, -1), seq_len=shape["seq"])
            generator = torch.Generator().manual_seed(rank)
            x = torch.randn(local, b, shape["hidden"], generator=generator).to(dtype)
            x.requires_grad_()
            with counting() as forward:
                out, _ = module(x, inputs)
            with counting() as backward:
                out.float().square().sum().backward()
            results[f"{name}/{comm}"] = {
                "forward": dict(forward),
                "backward": dict(backward),
                "out_abs_sum": out.float().abs().sum().item(),
            }
    ps.destroy_model_parallel()
    return results


def per_token_numbers(shape: dict) -> dict:
    """Numbers a token one gather moves: the latent and rope key, against K and V (V at the QK
    width, as the allgather comm type pads it, and unpadded, as the model defines it)."""
    qk = shape["nope"] + shape["rope"]
    return {
        "latent": shape["kv_lora_rank"] + shape["rope"],
        "kv_padded": shape["heads"] * 2 * qk,
        "kv": shape["heads"] * (qk + shape["v"]),
    }


def measure(shapes: dict = SHAPES) -> dict:
    """Run `traffic_rank` on 2 gloo ranks; the JSON record's rows, each count checked against
    the formula (forward gather bytes = (cp - 1)/cp x seq x batch x numbers a token x bytes)."""
    from megacore.testing import run_distributed

    ranks = run_distributed(traffic_rank, 2, (shapes,), timeout=1200, nccl_rules=False)
    rows = []
    for name, shape in shapes.items():
        numbers = per_token_numbers(shape)
        element = torch.tensor([], dtype=getattr(torch, shape["dtype"])).element_size()
        other_tokens = shape["seq"] // 2 * shape["batch"]  # cp 2: the other rank's half
        expected = {
            "allgather": other_tokens * numbers["kv_padded"] * element,
            "latent": other_tokens * numbers["latent"] * element,
        }
        checksums = [ranks[0][f"{name}/{comm}"]["out_abs_sum"] for comm in COMMS]
        for comm in COMMS:
            worst = max((r[f"{name}/{comm}"] for r in ranks), key=lambda r: r["forward"]["p2p"])
            fwd, bwd = worst["forward"], worst["backward"]
            received = fwd["all_gather"] + fwd["p2p"]
            if comm in expected and received != expected[comm]:
                raise AssertionError(
                    f"{name}/{comm}: counted {received} B, formula {expected[comm]}"
                )
            rows.append(
                {
                    "shape": name,
                    "comm": comm,
                    "cp": 2,
                    "seq_length": shape["seq"],
                    "batch": shape["batch"],
                    "dtype": shape["dtype"],
                    "forward_kv_bytes_received": received,
                    "backward_kv_grad_bytes_received": bwd["reduce_scatter"] + bwd["p2p"],
                    "backward_kv_regather_bytes": bwd["all_gather"],
                    "meta_bytes_received": fwd["meta"] + bwd["meta"],
                    "forward_bytes_per_other_token": received / other_tokens,
                }
            )
        # The same layer's output whatever the comm type (relative spread of |out|'s sum).
        rows[-1]["out_abs_sum_relative_spread_over_comms"] = (
            max(checksums) - min(checksums)
        ) / max(checksums)
    return {"rows": rows, "per_token_numbers": {n: per_token_numbers(s) for n, s in shapes.items()}}
