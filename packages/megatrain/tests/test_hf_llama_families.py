"""The Llama-like families both ways against transformers: Qwen2 and Qwen3 (dense), and the
mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE.  With them the attention switches they
need: `model.add_qkv_bias` (Qwen2's q, k, v biases), `model.qk_layernorm` (Qwen3's per-head
q/k RMSNorm before RoPE) and `model.kv_channels` (Qwen3's head_dim, here 16 at hidden 32
and 4 heads); and the MoE fields: experts stacked into the grouped GEMM's 3-D weights, HF's
routing (softmax over all, top k, renormalized or not), Qwen2-MoE's shared expert and its
sigmoid gate, Qwen's dense layers (`mlp_only_layers`) as a `moe_layer_freq` list.

Random tiny HF models (every weight perturbed: biases and norms too, so a misplaced tensor
shows) are imported, run by `megatrain.inference.load_model` in a gloo world of one in this
process, compared in fp32 (logits, greedy generation with and without the KV cache),
exported back and reloaded with AutoModelForCausalLM.  The tensor-parallel sums of the
q/k norms' gradients are proven in test_llama.py's multi-query layouts (tp 2 against one
process).
"""

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from megacore import parallel_state as ps
from megatrain.testing import world_of_one

VOCAB = 96


def _tokenizer(root):
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(root / "tokenizer.json"))


def random_hf(root, model_type: str, **overrides):
    """A random transformers model of `model_type` saved with a tokenizer, every parameter
    perturbed (HF starts biases at zero and norms at one)."""
    import transformers

    torch.manual_seed(0)
    fields = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, initializer_range=0.5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    fields.update(overrides)
    config = transformers.AutoConfig.for_model(model_type, **fields)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.eval().save_pretrained(root)
    _tokenizer(root)
    return model


def both_ways(root, name: str, hf, new_tokens: int = 12) -> dict:
    """Import `root / name`'s model, compare with `hf`, export back and reload."""
    import transformers

    from megatrain.hf import export_hf, import_hf
    from megatrain.inference.generate import Sampling, generate
    from megatrain.inference.load import load_model
    from megatrain.plan.accounting import parameter_count

    import_hf(root / name, root / f"{name}-ckpt")
    loaded = load_model(root / f"{name}-ckpt", torch.device("cpu"))
    model = loaded.chunks[0]
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    greedy = Sampling(max_new_tokens=new_tokens, greedy=True, stop_at_eod=False)
    prompt = tokens[0, :8].tolist()
    with torch.no_grad():
        ours = model(tokens).transpose(0, 1)[..., :VOCAB]
        theirs = hf(tokens).logits
        cached = generate(model, prompt, greedy)
        uncached = generate(model, prompt, greedy, use_cache=False)
        theirs_ids = hf.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
    export_hf(root / f"{name}-ckpt", root / f"{name}-export", progress=False)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        root / f"{name}-export", attn_implementation="eager", experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        back_logits = back(tokens).logits
    a, b = hf.state_dict(), back.state_dict()
    unwindowed = 0.0
    if getattr(hf.config, "sliding_window", None) is not None:
        fields = hf.config.to_dict()
        if fields["model_type"] == "gpt_oss":  # its layers slide unless named full
            fields["layer_types"] = ["full_attention"] * fields["num_hidden_layers"]
        else:
            fields |= {"sliding_window": None, "layer_types": None}
        full = transformers.AutoConfig.for_model(**fields)
        plain = transformers.AutoModelForCausalLM.from_config(
            full, attn_implementation="eager", experts_implementation="eager"
        ).eval()
        plain.load_state_dict(a)
        with torch.no_grad():
            unwindowed = (plain(tokens).logits - theirs).abs().max().item()
    section = loaded.meta["config"]["model"]
    return {
        "logits_max_diff": (ours - theirs).abs().max().item(),
        "logits_scale": theirs.abs().mean().item(),
        "export_equal": set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a),
        "export_logits_diff": (back_logits - theirs).abs().max().item(),
        "unwindowed_logits_diff": unwindowed,
        "architecture": type(back).__name__,
        "config": json.loads((root / f"{name}-export" / "config.json").read_text()),
        "generated": (cached, uncached, theirs_ids),
        "counted": parameter_count("llama", loaded.config),
        "built": sum(p.numel() for p in model.parameters()),
        "model": {k: section[k] for k in
                  ("kv_channels", "qk_layernorm", "add_qkv_bias", "num_query_groups",
                   "num_moe_experts", "moe_layer_freq", "moe_shared_expert_intermediate_size",
                   "moe_router_norm_topk_prob", "window_size", "layer_types")},
    }  # fmt: skip


# The small experts of the MoE families: 4 experts of 16, 2 per token.
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
MODELS = {  # name -> (model_type, config overrides)
    # Tied, grouped-query (our `q` and `kv` with biases).
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    # Untied, one key/value head per head (our per-head `qkv`), heads of 16 at hidden 32.
    "qwen3": ("qwen3", {"tie_word_embeddings": False, "head_dim": 16, "num_key_value_heads": 4}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2,
                            "intermediate_size": 16}),
    # The first layer dense (mlp_only_layers), the second with the shared expert and its gate;
    # the top-2 weights not renormalized.
    "qwen2_moe": ("qwen2_moe", {**MOE, "num_experts": 4, "shared_expert_intermediate_size": 24,
                                "mlp_only_layers": [0], "norm_topk_prob": False}),
    "qwen3_moe": ("qwen3_moe", {**MOE, "num_experts": 4, "norm_topk_prob": True,
                                "head_dim": 16}),
    # Sliding windows of 3 keys (the logits' sequences are 24 long, generation 20): Mistral's
    # on every layer, Qwen2's on the layers from max_window_layers on, Mixtral's on every layer.
    "mistral_window": ("mistral", {"sliding_window": 3}),
    "qwen2_window": ("qwen2", {"use_sliding_window": True, "sliding_window": 3,
                               "max_window_layers": 1}),
    "mixtral_window": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                   "intermediate_size": 16, "sliding_window": 3}),
}  # fmt: skip


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    threads = torch.get_num_threads()
    # One thread: these tiny matrices gain nothing from more, and on a shared CPU the
    # threads' contention makes each small GEMM take milliseconds (15x the run).
    torch.set_num_threads(1)
    try:
        hf = {name: random_hf(root / name, t, **o) for name, (t, o) in MODELS.items()}
        with world_of_one(root / "rendezvous"):
            ps.initialize_model_parallel(1, 1)
            return {name: both_ways(root, name, model) for name, model in hf.items()}
    finally:
        torch.set_num_threads(threads)


def test_llama_families_both_ways_exact(families):
    dense = {
        "num_moe_experts": None,
        "moe_layer_freq": 1,
        "moe_shared_expert_intermediate_size": None,
        "moe_router_norm_topk_prob": None,  # unset: the score function's own
    }
    expected = {
        "qwen2": ("Qwen2ForCausalLM", {"add_qkv_bias": True, "qk_layernorm": False,
                                       "kv_channels": None, "num_query_groups": 2, **dense}),
        "qwen3": ("Qwen3ForCausalLM", {"add_qkv_bias": False, "qk_layernorm": True,
                                       "kv_channels": 16, "num_query_groups": None, **dense}),
        "mixtral": ("MixtralForCausalLM", {"add_qkv_bias": False, "qk_layernorm": False,
                    "kv_channels": None, "num_query_groups": 2, "num_moe_experts": 4,
                    "moe_layer_freq": 1, "moe_shared_expert_intermediate_size": None,
                    "moe_router_norm_topk_prob": True}),
        "qwen2_moe": ("Qwen2MoeForCausalLM", {"add_qkv_bias": True, "qk_layernorm": False,
                      "kv_channels": None, "num_query_groups": 2, "num_moe_experts": 4,
                      "moe_layer_freq": [0, 1], "moe_shared_expert_intermediate_size": 24,
                      "moe_router_norm_topk_prob": False}),
        "qwen3_moe": ("Qwen3MoeForCausalLM", {"add_qkv_bias": False, "qk_layernorm": True,
                      "kv_channels": 16, "num_query_groups": 2, "num_moe_experts": 4,
                      "moe_layer_freq": 1, "moe_shared_expert_intermediate_size": None,
                      "moe_router_norm_topk_prob": True}),
    }  # fmt: skip
    windowed = {
        "mistral_window": ("MistralForCausalLM", {"add_qkv_bias": False, "qk_layernorm": False,
                           "kv_channels": None, "num_query_groups": 2, **dense,
                           "window_size": 3, "layer_types": None}),
        "qwen2_window": ("Qwen2ForCausalLM", {**expected["qwen2"][1], "window_size": 3,
                         "layer_types": ["full_attention", "sliding_attention"]}),
        "mixtral_window": ("MixtralForCausalLM", {**expected["mixtral"][1], "window_size": 3,
                           "layer_types": None}),
    }  # fmt: skip
    for _, model in expected.values():
        model |= {"window_size": None, "layer_types": None}
    expected |= windowed
    assert set(families) == set(expected)
    for name, r in families.items():
        architecture, model = expected[name]
        assert r["model"] == model, (name, r["model"])
        assert r["logits_scale"] > 1e-2, r  # not a zero model
        assert r["logits_max_diff"] < 1e-4, (name, r["logits_max_diff"])
        assert r["export_equal"], name
        assert r["export_logits_diff"] == 0.0, name
        assert r["architecture"] == architecture
        # Only qwen2 asks for tied embeddings; transformers' default (and qwen2_window's) is untied.
        assert r["config"]["tie_word_embeddings"] == (name == "qwen2")
        cached, uncached, theirs = r["generated"]
        assert cached == uncached == theirs and len(cached) == 12, (name, r["generated"])
        # kv_channels, q/k norms, qkv biases, experts, routers and shared experts counted
        assert r["counted"] == r["built"], name
    assert families["qwen3"]["config"]["head_dim"] == 16
    assert families["qwen2_moe"]["config"]["mlp_only_layers"] == [0]
    assert families["qwen2_moe"]["config"]["norm_topk_prob"] is False
    # The windows written back, and they mattered: the same weights without them differ.
    assert families["mistral_window"]["config"]["sliding_window"] == 3
    qwen2 = families["qwen2_window"]["config"]
    assert qwen2["use_sliding_window"] and qwen2["sliding_window"] == 3
    assert qwen2["layer_types"] == ["full_attention", "sliding_attention"]
    assert families["mixtral_window"]["config"]["sliding_window"] == 3
    for name in windowed:
        assert families[name]["unwindowed_logits_diff"] > 1e-2, name


@pytest.mark.parametrize(
    ("model_type", "change", "message"),
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 0},
         r"sliding_window is 0: expected a positive number of keys"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4,
                   "layer_types": ["full_attention"]}, r"layer_types must name each of the 2"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4,
                   "layer_types": ["full_attention", "local"]}, r"layer_types has 'local'"),
        ("qwen3", {"attention_bias": True}, r"attention_bias is True: biases on the output"),
        ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"rope type 'yarn'"),
        ("mixtral", {"router_jitter_noise": 0.1}, r"router_jitter_noise is 0.1: router jitter"),
        ("mixtral", {"sliding_window": -1}, r"sliding_window is -1: expected a positive"),
        ("qwen3_moe", {"moe_intermediate_size": 16, "q_lora_rank": 8}, r"q_lora_rank is 8: "),
        ("qwen2_moe", {"moe_intermediate_size": 16, "use_sliding_window": True,
                       "sliding_window": "4"}, r"sliding_window is '4'"),
    ],
)  # fmt: skip
def test_unsupported_fields_are_refused_before_any_weight_is_read(
    tmp_path, model_type, change, message, monkeypatch
):
    config = {"model_type": model_type, "vocab_size": VOCAB, "hidden_size": 32,
              "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
              "eos_token_id": 2, **change}  # fmt: skip
    assert_refused_before_reading(tmp_path, config, message, monkeypatch)


def assert_refused_before_reading(tmp_path, config: dict, message: str, monkeypatch) -> None:
    """import-hf of a directory holding `config` (as config.json) and a tokenizer is refused
    with `message` before any weight is opened, and writes no checkpoint."""
    from megatrain.hf import HFFormatError, import_hf

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(config))
    _tokenizer(hf_dir)
    monkeypatch.setattr("safetensors.safe_open", None)  # the weights are never opened
    with pytest.raises(HFFormatError, match=message):
        import_hf(hf_dir, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_a_file_of_fused_experts_reads_as_the_per_expert_one(tmp_path, name):
    """transformers 5 holds the experts as 3-D `mlp.experts.gate_up_proj` / `down_proj` (and
    Mixtral's under mlp., not block_sparse_moe.); a file saved from that state dict imports
    to the same checkpoint as the per-expert file save_pretrained writes."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from megatrain.checkpoint.load import read_full_state
    from megatrain.hf import import_hf

    model_type, overrides = MODELS[name]
    hf = random_hf(tmp_path / "per-expert", model_type, **overrides)
    shutil.copytree(tmp_path / "per-expert", tmp_path / "fused")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(state, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    with safe_open(str(tmp_path / "fused" / "model.safetensors"), framework="pt") as f:
        assert "model.layers.1.mlp.experts.gate_up_proj" in set(f.keys())
    states = []
    for kind in ("per-expert", "fused"):
        import_hf(tmp_path / kind, tmp_path / f"{kind}-ckpt")
        states.append(read_full_state(tmp_path / f"{kind}-ckpt", progress=False)[1])
    per_expert, fused = states
    assert set(per_expert) == set(fused) and "layers.1.mlp.experts.weight1" in fused
    assert all(torch.equal(per_expert[k], fused[k]) for k in fused)
