"""Device-true construction: `build_gpt_chunks` builds in place and leaves the RNGs alone.

One 4-rank spawn builds a tiny GPT at tp 2 x pp 2 x vpp 2 directly on the device (the GPU
when there is one, else the CPU) in bf16, and checks that every parameter is there in that
dtype, that building left the global generators (CPU, CUDA and the tensor-parallel
tracker's) exactly as they were, that the last stage's copy of the tied embeddings was
synced, on that device (held to NCCL's rules by `nccl_semantics`: the sync is a collective
and NCCL takes only tensors on the rank's GPU), and that the weights, gathered over the
layout, are the numbers the earlier construction drew (torch.manual_seed per piece, on the
CPU, then cast): layouts and the generator switch change no initial value.
"""

import math

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore import tensor_parallel as tp
from megacore.testing import count_tp_collectives, nccl_semantics, run_distributed
from megatrain.models.gpt import GPTConfig, build_gpt_chunks

SEED = 1234
FIG4_SEQ, FIG4_BATCH = 8, 2
CFG = dict(
    num_layers=4,
    hidden_size=16,
    num_attention_heads=4,
    vocab_size=64,
    true_vocab_size=50,  # padding rows stay zero
    max_position_embeddings=16,
    init_method_std=0.02,
)


def _old_weights(cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The random weights as the construction before device-true building drew them:
    the global generator reseeded per piece, full float32 tensors on the CPU."""
    std, n, h, f = cfg.init_method_std, cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size
    scaled = std / math.sqrt(2.0 * n)
    out = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        emb = torch.zeros(cfg.vocab_size, h)
        emb[: cfg.true_vocab_size].normal_(0.0, std)
        out["embedding.weight"] = emb
        torch.manual_seed(SEED - 1)
        out["position_embedding.weight"] = torch.empty(cfg.max_position_embeddings, h).normal_(
            0.0, std
        )
        for i in range(n):
            torch.manual_seed(SEED + 1 + i)  # drawn in construction order
            for name, shape, sigma in (
                ("attention.qkv", (3 * h, h), std),
                ("attention.proj", (h, h), scaled),
                ("mlp.fc1", (f, h), std),
                ("mlp.fc2", (h, f), scaled),
            ):
                out[f"layers.{i}.{name}.weight"] = torch.empty(shape).normal_(0.0, sigma)
    return out


def _rng_states() -> list[torch.Tensor]:
    """Every generator state, flattened (the tracker keeps (cpu, cuda or None) per name)."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available():
        states.append(torch.cuda.get_rng_state())
    for _, pair in sorted(tp.get_rng_tracker().get_states().items()):
        states.extend(s for s in pair if s is not None)
    return states


def _full(p: torch.Tensor) -> torch.Tensor:
    """The unsharded value of a parameter, on the CPU in float32."""
    local = p.detach().float().cpu()
    world = ps.get_tensor_model_parallel_world_size()
    if not getattr(p, "tensor_model_parallel", False) or world == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return tp.unshard(shards, p.partition_dim, p.partition_stride)


def _build_in_place() -> dict:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16
    ps.initialize_model_parallel(2, 2, 2)
    tp.model_parallel_manual_seed(7)  # the tracker holds a state construction must not touch
    before = _rng_states()
    cfg = GPTConfig(**CFG)
    with nccl_semantics(device=device):
        chunks = build_gpt_chunks(cfg, SEED, device=device, dtype=dtype)
    after = _rng_states()
    old = _old_weights(cfg)
    placed, wrong = 0, []
    names = []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            placed += p.device == device and p.dtype == dtype
            names.append(name)
            full = _full(p)
            if name == "output_weight":  # the last stage's copy: the synced word embeddings
                expected = old["embedding.weight"]
            elif name in old:
                expected = old[name]
            elif name.endswith(("ln1.weight", "ln2.weight", "final_layernorm.weight")):
                expected = torch.ones_like(full)
            else:  # biases
                expected = torch.zeros_like(full)
            if not torch.equal(full, expected.to(dtype).float()):
                wrong.append(name)
    ps.destroy_model_parallel()
    return {
        "rng_unchanged": len(before) == len(after) > 1
        and all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "params": len(names),
        "placed": placed,
        "names": names,
        "wrong": wrong,
        "device": str(device),
    }


def _count_layer_collectives(sequence_parallel: bool) -> dict:
    """Collectives the model's transformer layers issue in one forward + backward at tp 2."""
    ps.initialize_model_parallel(2)
    cfg = GPTConfig(**CFG, sequence_parallel=sequence_parallel)
    (chunk,) = build_gpt_chunks(cfg, SEED)
    x = torch.randn(
        FIG4_SEQ, FIG4_BATCH, cfg.hidden_size, generator=torch.Generator().manual_seed(3)
    )
    if sequence_parallel:
        x = tp.scatter_to_sequence_parallel_region(x)
    x.requires_grad_(True)
    with count_tp_collectives() as counts:
        for layer in chunk.layers.values():
            x = layer(x)
        x.sum().backward()
    ps.destroy_model_parallel()
    return counts


def _build_and_count() -> dict:
    out = _build_in_place()
    out["counts"] = {sp: _count_layer_collectives(sp) for sp in (False, True)}
    return out


def test_build_gpt_chunks_in_place_leaves_rng_and_keeps_the_numbers():
    # NCCL's rules only around the build, for the build's device: the checks gather on the CPU.
    results = run_distributed(_build_and_count, world_size=4, timeout=180, nccl_rules=False)
    seen = set()
    for rank, out in enumerate(results):
        assert out["rng_unchanged"], f"rank {rank}: building the model changed a generator"
        assert out["placed"] == out["params"] > 0, (rank, out["device"])
        assert out["wrong"] == [], (rank, out["wrong"])
        seen.update(out["names"])
    # Every piece of the model was built somewhere, and the tied copy on the last stage.
    assert {f"layers.{i}.attention.qkv.weight" for i in range(4)} <= seen
    assert {"embedding.weight", "position_embedding.weight", "output_weight"} <= seen
    assert "final_layernorm.weight" in seen
    # Paper Fig. 4: two all-reduces forward and two backward per layer (attention and MLP);
    # sequence parallelism trades each for an all-gather and a reduce-scatter.
    layers = CFG["num_layers"]
    for out in results:
        assert out["counts"][False] == {
            "all_reduce": 4 * layers, "all_gather": 0, "reduce_scatter": 0, "wrong_group": 0
        }  # fmt: skip
        assert out["counts"][True] == {
            "all_reduce": 0, "all_gather": 4 * layers, "reduce_scatter": 4 * layers,
            "wrong_group": 0,
        }  # fmt: skip
