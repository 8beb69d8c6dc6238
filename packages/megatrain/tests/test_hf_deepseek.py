"""DeepSeek-V3 and DeepSeek-V2 through Hugging Face both ways (`hf.deepseek`), exact.

Random tiny transformers models, every parameter and the correction bias perturbed (HF starts
the router at zero... its bias at zero: ties that would prove nothing), with all of the family
in play: multi-latent attention with and without the query latent, YaRN with mscale !=
mscale_all_dim (the tables' attention factor and the softmax's mscale^2 both not 1), a dense
first layer (first_k_dense_replace), shared experts, V3's sigmoid group-limited routing (4
groups, the best 2, ranked by their top-2 sums) with its bias, normalization and scaling, V2's
softmax group_limited_greedy and greedy.  Each imported and run by `inference.load_model`:
fp32 logits within 1e-4 of HF's eager path, greedy generation with the latent cache equal to
HF's and the uncached; the export reloads in transformers with every tensor bit-equal and the
same logits; counted parameters = built = HF's.  The routing mattered: the same weights without
the correction bias (V3) or the groups differ.

A tiny V3 stored in DeepSeek's FP8 format (linears float8_e4m3fn with a weight_scale_inv per
block of 16 x 20, the edges partial; router, norms, embeddings bf16, the bias fp32), its
multi-token prediction layer model.layers.3.* beside the rest, imports equal to the import of
its dequantised file, the MTP tensors skipped with a line naming them.  Refusals name the field;
the published DeepSeek-V3 and V2-Lite configs count 671B / 37B and 15.7B / 2.4B.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_hf_llama_families import VOCAB, assert_refused_before_reading, both_ways, random_hf

from megacore import parallel_state as ps
from megatrain.testing import world_of_one

transformers = pytest.importorskip("transformers")

# A pretraining context of 4 under the 24 tokens compared: YaRN's interpolation is used.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
        "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 0.707, "mscale_all_dim": 1.0}  # fmt: skip
MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=8, qk_nope_head_dim=6,
           qk_rope_head_dim=4, v_head_dim=5)  # fmt: skip
EXPERTS = dict(n_routed_experts=8, moe_intermediate_size=16, n_shared_experts=2,
               first_k_dense_replace=1, num_hidden_layers=3)  # fmt: skip
MODELS = {  # name -> (model_type, config overrides)
    "v3": ("deepseek_v3", {**MLA, **EXPERTS, "q_lora_rank": 12, "num_experts_per_tok": 2,
                           "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                           "norm_topk_prob": True, "rope_parameters": YARN}),
    "v2": ("deepseek_v2", {**MLA, **EXPERTS, "q_lora_rank": 12, "num_experts_per_tok": 3,
                           "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                           "routed_scaling_factor": 1.5, "rope_parameters": YARN}),
    # V2-Lite's shape: no query latent, plain greedy top k, no rotary scaling.
    "v2_lite": ("deepseek_v2", {**MLA, **EXPERTS, "q_lora_rank": None,
                                "num_experts_per_tok": 2, "topk_method": "greedy"}),
}  # fmt: skip
EXPECTED = {  # name -> (class, our [model] fields)
    "v3": ("DeepseekV3ForCausalLM", {
        "q_lora_rank": 12, "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "moe_router_num_groups": 4,
        "moe_router_group_topk": 2, "moe_router_group_score_topk": 2,
        "moe_router_norm_topk_prob": True, "moe_router_topk_scaling_factor": 2.5,
        "moe_router_pre_softmax": False, "rope_type": "yarn"}),
    "v2": ("DeepseekV2ForCausalLM", {
        "q_lora_rank": 12, "moe_router_score_function": "softmax",
        "moe_router_enable_expert_bias": False, "moe_router_num_groups": 4,
        "moe_router_group_topk": 2, "moe_router_group_score_topk": 1,
        "moe_router_norm_topk_prob": False, "moe_router_topk_scaling_factor": 1.5,
        "moe_router_pre_softmax": True, "rope_type": "yarn"}),
    "v2_lite": ("DeepseekV2ForCausalLM", {
        "q_lora_rank": None, "moe_router_score_function": "softmax",
        "moe_router_enable_expert_bias": False, "moe_router_num_groups": None,
        "moe_router_group_topk": None, "moe_router_group_score_topk": None,
        "moe_router_norm_topk_prob": False, "moe_router_topk_scaling_factor": 1.0,
        "moe_router_pre_softmax": True, "rope_type": "rope"}),
}  # fmt: skip
SHARED = {"multi_latent_attention": True, "kv_lora_rank": 8, "qk_head_dim": 6,
          "qk_pos_emb_head_dim": 4, "v_head_dim": 5, "num_moe_experts": 8,
          "moe_ffn_hidden_size": 16, "moe_shared_expert_intermediate_size": 32,
          "moe_layer_freq": [0, 1, 1], "num_query_groups": None, "kv_channels": None}  # fmt: skip


def random_deepseek(root, model_type: str, **overrides):
    """A random DeepSeek saved with a tokenizer (`random_hf`), the correction bias perturbed
    too (HF starts it at zero): every weight and buffer of the files drawn."""
    model = random_hf(root, model_type, initializer_range=0.2, **overrides)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(root)
    return model


def _unrouted_logits_diff(hf) -> float:
    """How far HF's logits move on `both_ways`' tokens when the same weights route without
    the correction bias (zeroed) and the groups (one): 0 where the model has neither."""
    unrouted = {
        f: 1 for f in ("n_group", "topk_group") if getattr(hf.config, f, 1) not in (None, 1)
    }
    state = hf.state_dict()
    biased = any(k.endswith("e_score_correction_bias") for k in state)
    if not (unrouted or biased):
        return 0.0
    config = transformers.AutoConfig.for_model(**{**hf.config.to_dict(), **unrouted})
    plain = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    plain.load_state_dict(
        {k: torch.zeros_like(v) if k.endswith("e_score_correction_bias") else v
         for k, v in state.items()}
    )  # fmt: skip
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (plain(tokens).logits - hf(tokens).logits).abs().max().item()


def _both_ways(root, name: str, hf) -> dict:
    """`both_ways` (import, logits, generation, export, reload), with the whole [model] section
    imported, HF's parameter count and what the routing's bias and groups did."""
    from megatrain.checkpoint.files import find_checkpoint, read_meta

    r = both_ways(root, name, hf)
    r["model"] = read_meta(find_checkpoint(root / f"{name}-ckpt"))["config"]["model"]
    r["hf_parameters"] = sum(p.numel() for p in hf.parameters())
    r["unrouted_logits_diff"] = _unrouted_logits_diff(hf)
    return r


@pytest.fixture(scope="module")
def deepseeks(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend on a shared CPU
    try:
        with world_of_one(root / "rendezvous"):
            ps.initialize_model_parallel(1, 1)
            return {name: _both_ways(root, name, random_deepseek(root / name, t, **o))
                    for name, (t, o) in MODELS.items()}  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def test_deepseek_both_ways_exact(deepseeks):
    assert set(deepseeks) == set(EXPECTED)
    for name, r in deepseeks.items():
        architecture, fields = EXPECTED[name]
        model = r["model"]
        assert {k: model[k] for k in fields} == fields, name
        assert {k: model[k] for k in SHARED} == SHARED, name
        assert r["logits_scale"] > 1e-2, r  # not a zero model
        assert r["logits_max_diff"] < 1e-4, (name, r["logits_max_diff"])
        assert r["export_equal"], name
        assert r["export_logits_diff"] == 0.0, name
        assert r["architecture"] == architecture
        cached, uncached, theirs = r["generated"]
        assert cached == uncached == theirs and len(cached) == 12, (name, r["generated"])
        # Ours pad the embedding and the output layer's 96 rows to 128.
        padding = 2 * (128 - VOCAB) * 32
        assert r["counted"] == r["built"] == r["hf_parameters"] + padding, name
    # The routing's pieces were in play: without the bias and the groups HF's logits move.
    assert deepseeks["v3"]["unrouted_logits_diff"] > 1e-2
    assert deepseeks["v2"]["unrouted_logits_diff"] > 1e-2
    v3, v2 = deepseeks["v3"]["config"], deepseeks["v2"]["config"]
    assert v3["n_group"] == 4 and v3["topk_group"] == 2 and v3["routed_scaling_factor"] == 2.5
    assert v3["num_nextn_predict_layers"] == 0 and v3["rope_parameters"]["mscale"] == 0.707
    assert v2["topk_method"] == "group_limited_greedy"
    assert deepseeks["v2_lite"]["config"]["topk_method"] == "greedy"
    assert deepseeks["v2_lite"]["config"]["q_lora_rank"] is None


# --- DeepSeek's FP8 files, with their MTP layer ---------------------------------------------


def _with_mtp_layer(root) -> dict:
    """Add to the files of `random_deepseek`'s V3 in `root` the multi-token prediction layer
    DeepSeek's files hold after the last, model.layers.3.*: a decoder layer (layer 2's tensors,
    perturbed), enorm, hnorm, eh_proj, shared_head.norm, and its copies of the model's word
    embedding and output layer (embed_tokens, shared_head.head); num_nextn_predict_layers 1.
    Returns the layer's tensors."""
    from safetensors.torch import save_file

    state = load_file(root / "model.safetensors")
    g = torch.Generator().manual_seed(5)

    def noise(shape, mean=0.0):
        return mean + 0.2 * torch.randn(shape, generator=g)

    h = state["model.norm.weight"].shape[0]
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v + noise(v.shape)
           for k, v in state.items() if k.startswith("model.layers.2.")}  # fmt: skip
    mtp |= {
        "model.layers.3.enorm.weight": noise(h, 1.0),
        "model.layers.3.hnorm.weight": noise(h, 1.0),
        "model.layers.3.eh_proj.weight": noise((h, 2 * h)),
        "model.layers.3.shared_head.norm.weight": noise(h, 1.0),
        "model.layers.3.embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
        "model.layers.3.shared_head.head.weight": state["lm_head.weight"].clone(),
    }
    save_file({**state, **mtp}, str(root / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return mtp


def _rms(x, weight, eps=1e-6):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _deepseek_mtp_losses(hf, mtp: dict, seq: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP depth 1 written out with transformers' modules on tokens `seq`
    [b, s + 1]: at position i (of s - 1) eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)]), h the
    model's output after its final norm, through a DeepseekV3DecoderLayer holding the layer's
    tensors (causal, positions 0..s-2), shared_head.norm, the output layer; the cross entropy
    against t_{i+2}: [b, s - 1]."""
    import torch.nn.functional as F
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    config, prefix = hf.config, "model.layers.3."
    own = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
    state = {k[len(prefix) :]: v for k, v in mtp.items() if not k[len(prefix) :].startswith(own)}
    experts = range(config.n_routed_experts)
    name = "mlp.experts.{}.{}_proj.weight".format
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([state.pop(name(e, "gate")), state.pop(name(e, "up"))]) for e in experts]
    )
    state["mlp.experts.down_proj"] = torch.stack([state.pop(name(e, "down")) for e in experts])
    layer = DeepseekV3DecoderLayer(config, 3).eval()
    layer.load_state_dict(state)  # strict: every tensor of the layer, and nothing else
    tokens = seq[:, :-1]
    n = tokens.shape[1] - 1
    with torch.no_grad():
        hidden = hf.model(tokens).last_hidden_state[:, :n]
        embedded = hf.model.embed_tokens(tokens[:, 1:])
        x = F.linear(torch.cat([_rms(embedded, mtp[prefix + "enorm.weight"]),
                                _rms(hidden, mtp[prefix + "hnorm.weight"])], dim=-1),
                     mtp[prefix + "eh_proj.weight"])  # fmt: skip
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = layer(x, attention_mask=mask, position_ids=positions,
                  position_embeddings=hf.model.rotary_emb(x, positions))  # fmt: skip
        logits = hf.lm_head(_rms(x, mtp[prefix + "shared_head.norm.weight"]))
        return F.cross_entropy(logits.transpose(1, 2), seq[:, 2:], reduction="none")


def test_deepseek_v3_mtp_layer_is_deepseeks_both_ways(tmp_path, capsys):
    """A V3 whose files hold its MTP layer imports it as model.mtp_num_layers 1: our depth's
    loss per token equals DeepSeek's MTP written out with transformers' modules (1e-5), the
    main loss HF's; the layer's copies of the embedding and output layer are not read; the
    export writes every tensor of the layer back bit-equal (the copies from ours) and says
    num_nextn_predict_layers 1."""
    import torch.nn.functional as F
    from safetensors import safe_open

    from megatrain.hf import export_hf, import_hf
    from megatrain.inference.load import load_model
    from megatrain.models.mtp import mtp_targets

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = random_deepseek(tmp_path / "hf", MODELS["v3"][0], **MODELS["v3"][1]).eval()
        mtp = _with_mtp_layer(tmp_path / "hf")
        assert len(mtp) == 38 + 6  # layer 2's tensors, and its own six
        seq = torch.randint(0, VOCAB, (2, 25), generator=torch.Generator().manual_seed(3))
        theirs = _deepseek_mtp_losses(hf, mtp, seq)
        with world_of_one(tmp_path / "rendezvous"):
            ps.initialize_model_parallel(1, 1)
            import_hf(tmp_path / "hf", tmp_path / "ckpt")
            said = capsys.readouterr().out
            model = load_model(tmp_path / "ckpt", torch.device("cpu")).chunks[0]
            batch = mtp_targets({"tokens": seq[:, :-1], "labels": seq[:, 1:]}, 1)
            with torch.no_grad():
                ours = model(batch["tokens"], batch["labels"], mtp_tokens=batch["mtp_tokens"],
                             mtp_labels=batch["mtp_labels"])  # fmt: skip
                main = F.cross_entropy(hf(seq[:, :-1]).logits.transpose(1, 2), seq[:, 1:],
                                       reduction="none")  # fmt: skip
            export_hf(tmp_path / "ckpt", tmp_path / "export", progress=False)
    finally:
        torch.set_num_threads(threads)
    assert "reading the 1 multi-token prediction layer model.layers.3.* as " in said
    assert model.mtp is not None and batch["mtp_mask"][:, :23].all()
    torch.testing.assert_close(ours["mtp"][:, :23, 0], theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["lm"], main, rtol=1e-5, atol=1e-5)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    with safe_open(str(tmp_path / "export" / "model.safetensors"), framework="pt") as f:
        written = {k: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.3.")}  # noqa: SIM118
    assert written.keys() == mtp.keys()
    assert all(torch.equal(written[k], mtp[k]) for k in mtp)


BLOCK = [16, 20]  # partial in both dimensions of every tiny matrix (hidden 32, ...)


def _fp8_pair(root) -> dict:
    """The V3 with its MTP layer stored as DeepSeek publishes it (the layers' 2-D linears
    float8 with scales; the router, norms, embeddings and output layer and the MTP layer's
    copies of them bf16, the correction bias fp32) in `root / "fp8"`, and its weights
    dequantised by transformers in `root / "plain"`."""
    from test_hf_quantized import FP8, fp8_quantized, write_files
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    random_deepseek(root / "hf", MODELS["v3"][0], **MODELS["v3"][1])
    _with_mtp_layer(root / "hf")
    config = json.loads((root / "hf" / "config.json").read_text())
    state = load_file(root / "hf" / "model.safetensors")
    fp8, plain = {}, {}
    kept = ("gate.weight", "embed_tokens.weight", "shared_head.head.weight")
    for key, t in state.items():
        if key.startswith("model.layers.") and t.dim() == 2 and not key.endswith(kept):
            w, s = fp8_quantized(t, BLOCK)
            fp8[key], fp8[f"{key}_scale_inv"] = w, s
            plain[key] = _dequantize_fp8_weight(w, s, BLOCK, torch.float32).bfloat16()
        else:
            fp8[key] = plain[key] = t.float() if "correction_bias" in key else t.bfloat16()
    config["dtype"] = "bfloat16"
    for name, tensors, quantization in (("fp8", fp8, FP8), ("plain", plain, None)):
        write_files(root / name, tensors, quantization, split=[k for k in tensors if "scale" in k])
        block = {"quantization_config": {**FP8, "weight_block_size": BLOCK}} if quantization else {}
        (root / name / "config.json").write_text(json.dumps({**config, **block}))
        shutil.copy(root / "hf" / "tokenizer.json", root / name)
    return fp8


def test_deepseek_fp8_files_with_their_mtp_layer_import_as_dequantised(tmp_path):
    from megatrain.checkpoint.load import read_full_state
    from megatrain.hf import import_hf

    fp8 = _fp8_pair(tmp_path)
    assert sum(t.dtype == torch.float8_e4m3fn for t in fp8.values()) >= 20
    assert fp8["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (1, 2)
    assert fp8["model.layers.3.eh_proj.weight"].dtype == torch.float8_e4m3fn
    for source in ("fp8", "plain"):
        import_hf(tmp_path / source, tmp_path / f"{source}-ckpt")
    meta, ours = read_full_state(tmp_path / "fp8-ckpt", progress=False)
    _, reference = read_full_state(tmp_path / "plain-ckpt", progress=False)
    assert meta["imported_from"]["dequantized_from"] == "fp8"
    assert meta["config"]["model"]["mtp_num_layers"] == 1
    assert ours.keys() == reference.keys() and "mtp.layers.0.eh_proj.weight" in ours
    assert "layers.2.mlp.router.expert_bias" in ours
    for name, t in reference.items():
        assert torch.equal(ours[name], t), name
    assert ours["mtp.layers.0.layer.mlp.router.expert_bias"].dtype == torch.float32
    assert ours["layers.1.attention.kv_a.weight"].dtype == torch.bfloat16


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "change", "message"),
    [
        ("deepseek_v3", {"rope_interleave": False}, r"rope_interleave is False"),
        ("deepseek_v3", {"attention_bias": True}, r"attention_bias is True"),
        ("deepseek_v3", {"num_key_value_heads": 2}, r"num_key_value_heads is 2"),
        ("deepseek_v3", {"scoring_func": "softmax"}, r"scoring_func is 'softmax'"),
        ("deepseek_v3", {"topk_method": "greedy"}, r"topk_method is 'greedy'"),
        ("deepseek_v3", {"moe_layer_freq": 2}, r"moe_layer_freq is 2"),
        ("deepseek_v3", {"n_group": 3}, r"n_group is 3: n_routed_experts \(8\) is not divisible"),
        ("deepseek_v3", {"topk_group": 5}, r"topk_group is 5: above n_group \(4\)"),
        ("deepseek_v3", {"qk_rope_head_dim": 5}, r"qk_rope_head_dim is 5: expected an even"),
        ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 8, "attention_factor": 2.0}},
         r"attention_factor is 2.0"),
        ("deepseek_v2", {"topk_method": "noaux_tc"}, r"topk_method is 'noaux_tc'"),
        ("deepseek_v2", {"norm_topk_prob": True}, r"norm_topk_prob is True"),
        ("deepseek_v2", {"mlp_bias": True}, r"mlp_bias is True"),
        ("deepseek_v2", {"topk_method": "group_limited_greedy"}, r"n_group is None"),
    ],
)  # fmt: skip
def test_what_we_do_not_compute_is_refused_naming_the_field(
    tmp_path, model_type, change, message, monkeypatch
):
    config = {"model_type": model_type, "vocab_size": VOCAB, "hidden_size": 32,
              "intermediate_size": 48, "eos_token_id": 2, **MLA, **EXPERTS,
              "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, **change}  # fmt: skip
    if model_type == "deepseek_v2" and "topk_method" in change:
        config = {k: v for k, v in config.items() if k not in ("n_group", "topk_group")}
    assert_refused_before_reading(tmp_path, config, message, monkeypatch)


def test_an_export_deepseek_cannot_hold_is_refused_naming_the_field(tmp_path):
    from megatrain.checkpoint.files import CheckpointError
    from megatrain.hf.families import deepseek_family

    base = {"num_layers": 3, "num_moe_experts": 8, "moe_router_topk": 2,
            "moe_ffn_hidden_size": 16, "ffn_hidden_size": 48,
            "moe_shared_expert_intermediate_size": 32, "moe_layer_freq": [0, 1, 1],
            "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_pre_softmax": False, "moe_router_norm_topk_prob": None,
            "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None,
            "moe_router_group_topk": None, "moe_router_group_score_topk": None,
            "moe_aux_loss_coeff": 0.0, "moe_router_load_balancing_type": "none",
            "num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 8,
            "qk_head_dim": 6, "qk_pos_emb_head_dim": 4, "v_head_dim": 5,
            "multi_latent_attention": True}  # fmt: skip
    fields = deepseek_family(base).fields(base)
    assert fields["norm_topk_prob"] is True and fields["first_k_dense_replace"] == 1
    assert fields["n_shared_experts"] == 2 and fields["n_group"] == 1
    for change, named in [
        ({"moe_layer_freq": [1, 0, 1]}, "model.moe_layer_freq"),
        ({"moe_shared_expert_intermediate_size": 24}, "model.moe_shared_expert_intermediate"),
        ({"moe_router_enable_expert_bias": False}, "model.moe_router_enable_expert_bias"),
        ({"moe_router_num_groups": 4, "moe_router_group_topk": 2,
          "moe_router_group_score_topk": 1}, "model.moe_router_group_score_topk"),
        ({"moe_router_score_function": "softmax", "moe_router_pre_softmax": False},
         "model.moe_router_pre_softmax"),
        ({"moe_router_score_function": "softmax", "moe_router_pre_softmax": True,
          "moe_router_norm_topk_prob": True}, "model.moe_router_norm_topk_prob"),
    ]:  # fmt: skip
        m = {**base, **change}
        with pytest.raises(CheckpointError, match=named):
            deepseek_family(m).fields(m)


# --- the published models, counted ----------------------------------------------------------

# DeepSeek-V3's config.json as published (deepseek-ai/DeepSeek-V3), the fields it holds.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "ep_size": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 163840, "initializer_range": 0.02, "rms_norm_eps": 1e-06,
    "use_cache": True, "bos_token_id": 0, "eos_token_id": 1, "pretraining_tp": 1,
    "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "attention_bias": False, "attention_dropout": 0.0, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
}  # fmt: skip
# DeepSeek-V2-Lite's (deepseek-ai/DeepSeek-V2-Lite).
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64, "ep_size": 1,
    "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6,
    "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
    "scoring_func": "softmax", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 163840, "initializer_range": 0.02, "rms_norm_eps": 1e-06,
    "use_cache": True, "bos_token_id": 100000, "eos_token_id": 100001, "pretraining_tp": 1,
    "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "attention_bias": False, "attention_dropout": 0.0, "torch_dtype": "bfloat16",
}  # fmt: skip


def _counted(tmp_path, published: dict):
    """(run config, TransformerConfig) of a published config.json as import-hf resolves it."""
    from megatrain.hf.decoder import decoder_config
    from megatrain.hf.deepseek import configure_deepseek, read_deepseek_config
    from megatrain.models import model_config

    (tmp_path / "config.json").write_text(json.dumps(published))
    config = decoder_config(tmp_path, read_deepseek_config(tmp_path), configure_deepseek)
    return config, model_config(config, published["vocab_size"])


def test_published_deepseek_configs_count_their_published_sizes(tmp_path):
    """DeepSeek-V3: 671B total, 37B activated a token (the paper's and the model card's), and
    with its multi-token prediction layer (num_nextn_predict_layers 1, our mtp_num_layers)
    the files' "685B" (DeepSeek: 671B + 14B): ours count its layer, eh_proj and norms
    (11.6B) and share the model's embedding and output layer, of which the files hold a copy
    each (1.85B) beside them: 684.5B.  DeepSeek-V2-Lite: 15.7B total, 2.4B activated.
    DeepSeek's activated counts leave out the word embedding (a lookup), ours hold it."""
    from megatrain.plan import accounting as acc

    config, cfg = _counted(tmp_path, DEEPSEEK_V3)
    m = config.model
    assert (m.rope_type, m.rotary_scaling_factor, m.mscale_all_dim) == ("yarn", 40.0, 1.0)
    assert (m.moe_router_num_groups, m.moe_router_group_topk) == (8, 4)
    assert m.moe_layer_freq == [0, 0, 0] + [1] * 58 and m.mtp_num_layers == 1
    assert m.moe_router_load_balancing_type == "seq_aux_loss" and m.moe_aux_loss_coeff == 0.001
    embedding = DEEPSEEK_V3["vocab_size"] * DEEPSEEK_V3["hidden_size"]
    total, mtp = acc.gpt_parameters(cfg), acc.mtp_parameters(cfg)
    assert round((total - mtp) / 1e9) == 671  # 671.03B
    assert round((total + 2 * embedding) / 1e9, 1) == 684.5  # the files' copies: "685B"
    # 37.55B with the word embedding's 0.93B, which DeepSeek leaves out: 36.6B.
    assert round((acc.active_parameters(cfg) - embedding) / 1e9) == 37
    (tmp_path / "lite").mkdir()
    config, cfg = _counted(tmp_path / "lite", DEEPSEEK_V2_LITE)
    assert config.model.moe_router_num_groups is None and config.model.q_lora_rank is None
    assert round(acc.gpt_parameters(cfg) / 1e9, 1) == 15.7
    embedding = DEEPSEEK_V2_LITE["vocab_size"] * DEEPSEEK_V2_LITE["hidden_size"]
    assert 2.4e9 <= acc.active_parameters(cfg) - embedding < 2.5e9  # 2.45B; DeepSeek truncates


def test_shipped_deepseek_tiny_trained_here_exports_exactly(tmp_path):
    """pipelines/models/deepseek-tiny.toml trained a step here (its expert biases moved by the
    step's loads) exports as DeepseekV3ForCausalLM whose fp32 logits are ours within 1e-4,
    and the export imports back to the trained checkpoint's every tensor (its MTP depth and
    expert biases included), bit for bit; a bf16 export keeps the expert biases float32."""
    from safetensors import safe_open
    from test_hf_export_resolved import MODELS as SHIPPED
    from test_hf_export_resolved import _run, _texts

    from megatrain.checkpoint.load import read_full_state
    from megatrain.hf import export_hf, import_hf
    from megatrain.inference.load import load_model
    from megatrain.run.loop import train
    from megatrain.testing import write_text_corpus

    corpus, _ = write_text_corpus(tmp_path / "corpus", _texts(40), vocab_size=200)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch, world_of_one(tmp_path / "rendezvous"):
            patch.setenv("OMP_NUM_THREADS", "1")
            train(_run(SHIPPED / "deepseek-tiny.toml", corpus, tmp_path))
            export_hf(tmp_path / "ckpt", tmp_path / "hf", progress=False)
            export_hf(tmp_path / "ckpt", tmp_path / "bf16", "bfloat16", progress=False)
            import_hf(tmp_path / "hf", tmp_path / "back")
            ps.initialize_model_parallel(1, 1)  # train() took its groups down
            model = load_model(tmp_path / "ckpt", torch.device("cpu")).chunks[0]
            vocab = model.config.true_vocab_size
            tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                ours = model(tokens).transpose(0, 1)[..., :vocab]
    finally:
        torch.set_num_threads(threads)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager", experts_implementation="eager"
    ).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max() < 1e-4
    _, trained = read_full_state(tmp_path / "ckpt", progress=False)
    meta, back = read_full_state(tmp_path / "back", progress=False)
    assert meta["config"]["model"]["mtp_num_layers"] == 1
    weights = {k: v for k, v in trained.items() if "/" not in k}  # not the optimizer state
    assert weights.keys() == back.keys() and "mtp.layers.0.layer.mlp.router.expert_bias" in back
    assert all(torch.equal(weights[k], back[k]) for k in weights)
    assert back["layers.1.mlp.router.expert_bias"].abs().max() > 0  # moved by the step
    # A bf16 export keeps the expert biases float32 (transformers holds them so): ours exactly.
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    biases = {k: t for k, t in stored.items() if k.endswith("e_score_correction_bias")}
    assert len(biases) == 4  # layers 1-3 and the MTP depth's
    assert all(t.dtype == torch.float32 for t in biases.values())
    assert all(t.dtype == torch.bfloat16 for k, t in stored.items() if k not in biases)
    assert torch.equal(biases["model.layers.1.mlp.gate.e_score_correction_bias"],
                       weights["layers.1.mlp.router.expert_bias"])  # fmt: skip


# --- run --load-hf at a layout ---------------------------------------------------------------

LOAD_LAYOUTS = {  # name -> overrides; 2 ranks
    "tp2-sp": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
    "ep2": ["parallel.expert_model_parallel_size=2", "model.moe_grouped_gemm=false"],
    # Uneven stages: the 3 layers on the first, the MTP layer alone on the last with the
    # output layer and the loss (its copy of the word embeddings read from the files too).
    "pp2-uneven": [
        "parallel.pipeline_model_parallel_size=2",
        "parallel.pipeline_model_parallel_layout='Ettt|mL'",
    ],
}


def _load_hf_runs(root, out, layouts):
    """`train`'s histories from the V3's files through `--load-hf` at each layout (rank 0's)."""
    from test_hf_load_layout import _config, _trained

    return {
        name: _trained(_config(root, "v3", f"{out}/{name}", [
            f"checkpoint.load_hf='{root}/v3'", *overrides]))
        for name, overrides in layouts.items()
    }  # fmt: skip


def test_load_hf_of_a_deepseek_at_tp2_sp_and_ep2_takes_the_one_process_steps(tmp_path):
    """`run --load-hf` of the tiny V3's files (its MTP layer too, so the MTP loss joins the
    steps) at tp 2 + sp (the latent down-projections whole on each rank, the heads split), at
    ep 2 and at uneven pp 2 stages "Ettt|mL" (2 gloo ranks, one spawn): one process's losses,
    grad norms and validation."""
    import hashlib

    from test_hf_load_layout import TOL
    from test_hf_load_layout import VOCAB as LOAD_VOCAB
    from tokenizers import Tokenizer, models, pre_tokenizers

    from megacore.testing import run_distributed
    from megatrain.testing import assert_same_steps, write_counting_corpus

    random_deepseek(tmp_path / "v3", MODELS["v3"][0], vocab_size=LOAD_VOCAB, **MODELS["v3"][1])
    _with_mtp_layer(tmp_path / "v3")
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(LOAD_VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "v3" / "tokenizer.json"))
    corpus = write_counting_corpus(tmp_path / "corpus", LOAD_VOCAB)
    manifest = json.loads((corpus / "manifest.json").read_text())
    sha = hashlib.sha256((tmp_path / "v3" / "tokenizer.json").read_bytes()).hexdigest()
    manifest["tokenizer"]["sha256"] = sha
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    one = {"one": []}
    reference = run_distributed(_load_hf_runs, 1, args=(tmp_path, str(tmp_path / "1"), one),
                                timeout=300)[0]["one"]  # fmt: skip
    runs = run_distributed(
        _load_hf_runs, 2, args=(tmp_path, str(tmp_path / "2"), LOAD_LAYOUTS), timeout=600
    )[0]
    assert reference["mtp_loss/depth1"][0] > 0 and len(reference["loss"]) == 2
    for name in LOAD_LAYOUTS:
        assert_same_steps(runs[name], reference, name, TOL)
        for a, b in zip(runs[name]["mtp_loss/depth1"], reference["mtp_loss/depth1"], strict=True):
            assert abs(a - b) < TOL, (name, runs[name]["mtp_loss/depth1"])
