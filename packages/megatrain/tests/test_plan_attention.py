"""`megatrain plan`'s attention as it runs: flash (Ampere and newer) against the 2019 unfused
kernels (V100, or asked for), in the time model, the memory model and the CLI; and the time
model's GEMMs from `accounting.layer_gemms`, the list the FLOP count sums."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.models import model_config
from megatrain.plan import hardware
from megatrain.plan.accounting import activations_per_layer, attention_kernel, layer_gemms
from megatrain.plan.attention_time import attention_core_seconds
from megatrain.plan.cost_model import estimate, layer_seconds
from megatrain.plan.costs import Costs
from megatrain.plan.layout import Layout, apply_layout
from megatrain.plan.memory import memory_breakdown

MODELS = Path(__file__).resolve().parents[3] / "pipelines" / "models"
GPUS = hardware.load_gpus()
H100, V100 = GPUS["h100-80gb"], GPUS["v100-32gb"]
VOCAB = 128256


def test_gpu_table_says_which_attention_runs():
    """Flash on A100 and newer (their profiles giving the kernel's published rate), the
    unfused kernels on V100, whose profile cannot time flash: asking for it is refused,
    naming the field."""
    for key, gpu in GPUS.items():
        rates = hardware.gpu_profile(gpu).attention_tflops
        if key.startswith("v100"):
            assert gpu.attention == "unfused" and not rates
        else:
            assert gpu.attention == "flash" and all(0 < t < 1000 for _, t in rates), key
    volta, hopper = hardware.gpu_profile(V100), hardware.gpu_profile(H100)
    with pytest.raises(hardware.HardwareError, match="attention_tflops"):
        hardware.with_attention(V100, "flash", volta)
    assert hardware.with_attention(H100, "unfused", hopper).attention == "unfused"
    assert hardware.with_attention(H100, None, hopper) is H100
    with pytest.raises(hardware.HardwareError, match="profile volta has none"):
        hardware.with_attention(H100, None, volta)


def test_gpu_file_attention_fields(tmp_path):
    entry = (
        '[gpu.x]\nname = "x"\nmemory_gib = 80\npeak_tflops = { bf16 = 100.0 }\nhbm_gbps = 1000\n'
        "intra_node_gbps = 100\ninter_node_gbps = 10\ngpus_per_node = 8\n"
    )
    path = tmp_path / "gpus.toml"
    # a new entry naming no profile gets volta's, which cannot time flash
    path.write_text(entry + 'attention = "flash"\n')
    with pytest.raises(hardware.HardwareError, match=r"\[gpu.x\] attention = \"flash\" needs"):
        hardware.load_gpus(path)
    path.write_text(entry + 'attention = "fused"\nprofile = "hopper"\n')
    with pytest.raises(hardware.HardwareError, match="attention must be"):
        hardware.load_gpus(path)
    path.write_text(entry + 'attention = "flash"\nprofile = "hopper"\n')
    assert hardware.load_gpus(path)["x"].profile == "hopper"


def test_flash_attention_terms_by_hand():
    """Llama 3 8B's attention core at tp 2, s 8192 on an H100: causal, so half of 4 s^2 (a d)
    FLOPs, at the hopper profile's attention_tflops at s 8192 (FlashAttention-2's 308), the
    backward 2.5 x, one kernel each; unfused: the two products per head as GEMMs, all s^2,
    as on a V100.  No flash in fp32."""
    config = apply_layout(load_config(MODELS / "llama3-8b.toml"), Layout(2, 1, 1, micro_batch=2))
    cfg = model_config(config, VOCAB)
    layout = Layout(tp=2, pp=1, dp=1, micro_batch=2)
    profile = hardware.gpu_profile(H100)
    costs = Costs(H100, profile, "bf16")
    s, b, heads, d = 8192, 2, 32 / 2, 128
    flops = b * heads * 4 * s * s * d / 2
    rate = 308e12
    [(forward, backward)] = attention_core_seconds(config, cfg, layout, costs)
    assert forward == pytest.approx(flops / rate + 20e-6)
    assert backward == pytest.approx(2.5 * flops / rate + 20e-6)
    unfused = Costs(replace(H100, attention="unfused"), profile, "bf16")
    core = attention_core_seconds(config, cfg, layout, unfused)
    assert core == [
        unfused.gemm_fwd_bwd(s, s, d, b * heads),  # QK^T, every score
        unfused.gemm_fwd_bwd(s, d, s, b * heads),  # scores x V
    ]
    fp32 = apply_layout(
        replace(config, training=replace(config.training, precision="fp32")), layout
    )
    assert len(attention_core_seconds(fp32, cfg, layout, Costs(H100, profile, "fp32"))) == 2
    # The layer: the same but for the core and the passes over the s x s scores (Korthikanti's
    # 5 a s^2 b / t bytes, forward once and backward twice), which flash does not make.
    fast, slow = (layer_seconds(config, layout, c, 450e9, cfg=cfg) for c in (costs, unfused))
    scores = 3 * unfused.elementwise(5 * 32 * s * s * b / 2)
    unfused_core = sum(f + bw for f, bw in core)
    assert slow["compute"] - fast["compute"] == pytest.approx(
        unfused_core + scores - forward - backward
    )
    assert fast["compute"] < slow["compute"]


def test_published_runs_attention_implementations_by_hand():
    """The two implementations published runs ran and megatrain does not, each timed as its
    kernel but for what differs: FlashAttention in Triton, the flash kernel's forward 1.4x and
    backward 2x FlashAttention-2's (Dao 2023, section 4.1); Megatron-LM's fused softmax, the
    unfused products with the bytes its kernels move over each score (4 + 5 with dropout
    forward, 6 + 5 backward) in place of the passes over what the 2019 ops keep.  Both keep
    what their kernel keeps."""
    config = apply_layout(load_config(MODELS / "llama3-8b.toml"), Layout(2, 1, 1, micro_batch=2))
    cfg = model_config(config, VOCAB)
    layout = Layout(tp=2, pp=1, dp=1, micro_batch=2)
    profile = hardware.gpu_profile(H100)
    flash, triton, unfused, fused = (
        Costs(replace(H100, attention=a), profile, "bf16")
        for a in ("flash", "flash_triton", "unfused", "fused_softmax")
    )
    [(forward, backward)] = attention_core_seconds(config, cfg, layout, flash)
    [(t_forward, t_backward)] = attention_core_seconds(config, cfg, layout, triton)
    overhead = profile.gemm_overhead_s
    assert t_forward - overhead == pytest.approx(1.4 * (forward - overhead))
    assert t_backward - overhead == pytest.approx(2.0 * (backward - overhead))
    assert attention_core_seconds(config, cfg, layout, fused) == attention_core_seconds(
        config, cfg, layout, unfused
    )
    for k, a in (("flash", "flash_triton"), ("unfused", "fused_softmax")):
        assert attention_kernel(config, a) == k
        assert activations_per_layer(config, "none", attention=a) == activations_per_layer(
            config, "none", attention=k
        )
    with pytest.raises(ValueError, match="attention must be one of"):
        attention_kernel(config, "xformers")
    s, b, a = 8192, 2, 32
    scores = a * s * s * b / 2  # the rank's heads' scores
    plain = layer_seconds(config, layout, unfused, 450e9, cfg=cfg)
    for dropout, moved in ((0.0, 4 + 6), (0.1, 9 + 11)):
        dropped = replace(config, model=replace(config.model, attention_dropout=dropout))
        got = layer_seconds(dropped, layout, fused, 450e9, cfg=cfg)
        # the unfused layer less its passes over the 5 bytes a score it keeps, plus the bytes
        assert got["compute"] == pytest.approx(
            plain["compute"]
            - 3 * unfused.elementwise(5 * scores)
            + unfused.memory_bound(moved * scores)
        )
    for recompute, again in (("selective", 4 + 5), ("full", 4 + 5)):
        dropped = replace(config, model=replace(config.model, attention_dropout=0.1))
        rerun = replace(layout, recompute=recompute)
        got, once = (
            layer_seconds(dropped, lay, fused, 450e9, cfg=cfg)["compute"] for lay in (rerun, layout)
        )
        # both rerun the forward's softmax and dropout (full reruns the rest of it too)
        assert got - once >= fused.memory_bound(again * scores) > 0


def test_time_model_gemms_are_the_models():
    """The layer's dense GEMMs on one TP rank are layer_gemms': Llama's q, grouped kv (one
    whole group a rank at tp 16 > 8 groups) and SwiGLU's three; GPT-2's four, as in 2019."""
    llama = model_config(load_config(MODELS / "llama3-8b.toml"), VOCAB)
    got = {g.name: g.per_rank(16) for g in layer_gemms(llama)}
    assert got == {
        "q": (4096, 256),
        "kv": (4096, 256),
        "proj": (256, 4096),
        "gate": (4096, 896),
        "fc1": (4096, 896),
        "fc2": (896, 4096),
    }
    gpt = model_config(load_config(MODELS / "gpt2-1.2b.toml"), 50257)
    h = gpt.hidden_size
    assert [g.per_rank(8) for g in layer_gemms(gpt)] == [
        (h, 3 * h / 8), (h / 8, h), (h, 4 * h / 8), (4 * h / 8, h)
    ]  # fmt: skip


def test_flash_memory_keeps_no_scores_and_the_plan_uses_it():
    """Recompute "none" with flash keeps the row statistic (4 a s b / t) where the unfused
    kernels keep Korthikanti's 5 a s^2 b / t; memory_breakdown's default (a real run's
    estimate) stays unfused; the plan on an H100 counts flash's, on a V100 the scores'."""
    config = apply_layout(load_config(MODELS / "llama3-8b.toml"), Layout(2, 1, 4, micro_batch=1))
    s, b, a, tp = 8192, 1, 32, 2
    selective = activations_per_layer(config, "selective")
    assert (
        activations_per_layer(config, "none", attention="flash") == selective + 4 * a * s * b / tp
    )
    assert activations_per_layer(config, "none") == selective + 5 * a * s * s * b / tp
    assert activations_per_layer(config, "selective", attention="flash") == selective
    unfused = memory_breakdown(config, "none", vocab_size=VOCAB, data_parallel_size=4)
    flash = memory_breakdown(
        config, "none", vocab_size=VOCAB, data_parallel_size=4, attention="flash"
    )
    assert memory_breakdown(config, "none", vocab_size=VOCAB, data_parallel_size=4) == unfused
    layers = 32
    assert unfused["activations"] - flash["activations"] == pytest.approx(
        layers * (5 * a * s * s * b / tp - 4 * a * s * b / tp)
    )
    layout = Layout(tp=2, pp=1, dp=4, micro_batch=1, recompute="none", sequence_parallel=True,
                    distributed_optimizer=True)  # fmt: skip
    profile = hardware.gpu_profile(H100)
    on_h100 = estimate(config, layout, H100, profile, VOCAB, 512)
    unfused = hardware.with_attention(H100, "unfused", profile)
    asked = estimate(config, layout, unfused, profile, VOCAB, 512)
    assert on_h100.memory["activations"] < asked.memory["activations"]
    assert on_h100.time["compute"] < asked.time["compute"] and on_h100.mfu > asked.mfu


def test_cli_attention_flag():
    config = str(MODELS / "llama-tiny.toml")  # a small search, to keep it quick
    args = ["plan", "--config", config, "--gpus", "2", "--gpu", "h100-80gb", "--top", "1",
            "model.vocab_size=256", "training.precision=bf16", "--json"]  # fmt: skip
    runs = {}
    for flag in ([], ["--attention", "unfused"]):
        result = CliRunner().invoke(main, [*args, *flag])
        assert result.exit_code == 0, result.output
        runs[tuple(flag)] = json.loads(result.output)
    assert runs[()]["gpu"]["attention"] == "flash"
    assert runs[("--attention", "unfused")]["gpu"]["attention"] == "unfused"
    assert runs[()]["layouts"][0]["mfu"] > runs[("--attention", "unfused")]["layouts"][0]["mfu"]
    bad = ["plan", "--config", config, "--gpus", "16", "--gpu", "v100-32gb", "--attention", "flash"]
    result = CliRunner().invoke(main, bad)
    assert result.exit_code == 2 and "attention_tflops" in result.output


def test_context_parallel_attention_kernels_by_hand(monkeypatch):
    """Under context parallelism the attention core runs as megacore runs it, never as flash
    (Llama 3 8B at 32k tokens, tp 2, cp 4, micro batch 2 on an H100; a rank's 16 heads and 4
    key/value groups of 128, its 8192 queries of each sequence against all 32768 keys):

    - all-gather, 16 bits: SDPA with megacore's boolean mask, one fused kernel (cuDNN's or the
      memory-efficient one) doing every score's FLOPs (4 queries keys d a head: no causal
      skipping, so at cp 2 a rank does what flash does for the whole sequence at cp 1), its
      bytes q, k, v, the output and the 16-bit additive mask read for each sequence and head;
      and the mask made and converted, 5 bytes a (query, key) pair, once (one causal mask)
      or per sequence (documents);
    - the ring (p2p), whatever the GPU's attention: cp blocks of two float32 batched GEMMs
      per head at the fp32 peak, and its torch ops over the float32 scores, memory-bound: 49
      bytes a score and head forward, 65 backward, and each block's mask (2 bytes a pair);
    - the all-gather in fp32 or asked unfused: the 2019 GEMMs."""
    profile = hardware.gpu_profile(H100)
    costs = Costs(H100, profile, "bf16")
    calls = []

    def kernel(self, flops, nbytes, *rest):
        calls.append((flops, nbytes))
        return flops * 1e-15, 2.5 * flops * 1e-15

    monkeypatch.setattr(Costs, "flash_attention", kernel)
    base = load_config(MODELS / "llama3-8b-32k.toml")
    s, b, local, heads, groups, d = 32768, 2, 8192, 2 * 16, 2 * 4, 128  # heads x b
    layout = Layout(tp=2, pp=1, dp=1, cp=4, cp_comm="allgather", micro_batch=2)
    config = apply_layout(base, layout)
    cfg = model_config(config, VOCAB)
    assert attention_kernel(config, "flash") == "masked"
    core = attention_core_seconds(config, cfg, layout, costs)
    flops = 4 * local * s * d * heads
    assert calls == [(flops, 2 * d * (2 * heads * local + 2 * groups * s) + 2 * heads * local * s)]
    assert core == [(flops * 1e-15, 2.5 * flops * 1e-15), (5 * local * s / costs.hbm, 0.0)]
    documents = apply_layout(
        replace(base, data=replace(base.data, reset_attention_mask=True)), layout
    )
    assert attention_core_seconds(documents, cfg, layout, costs)[1][0] == pytest.approx(
        b * 5 * local * s / costs.hbm
    )
    # At cp 2 a rank's masked kernel does the FLOPs of cp 1's flash kernel at the same s.
    calls.clear()
    for at in (Layout(tp=2, pp=1, dp=1, cp=2, cp_comm="allgather"), Layout(tp=2, pp=1, dp=1)):
        attention_core_seconds(apply_layout(base, at), cfg, at, costs)
    assert calls[0][0] == calls[1][0]

    ring = replace(layout, cp_comm="p2p")
    config = apply_layout(base, ring)
    assert attention_kernel(config, "flash") == attention_kernel(config, "unfused") == "ring"
    # The fused ring: 4 kernel calls of the rank's queries against a block of s / 4 keys,
    # causal attention's half of the scores, timed as one flash kernel (plus 3 calls' fixed
    # time) with the calls' bytes (q, a K/V block and the output each); each call's output
    # merged into a float32 accumulator (read, written) in the forward and the backward.
    block = s // 4
    calls.clear()
    core = attention_core_seconds(config, cfg, ring, costs)
    half = 4 * local * s * d * heads / 2
    assert calls == [(half, 4 * 2 * d * (2 * heads * local + 2 * groups * block))]
    merge = costs.memory_bound(4 * (2 * 4 + 2) * heads * local * d)
    extra = 3 * profile.gemm_overhead_s + merge
    assert len(core) == 1
    assert core[0] == pytest.approx((half * 1e-15 + extra, 2.5 * half * 1e-15 + extra))
    # On a GPU without the flash figure (or in fp32) the memory-efficient kernel: its two
    # products of each call timed as GEMMs of the visible half of the block's keys.
    unfused = Costs(replace(H100, attention="unfused"), profile, "bf16")
    assert attention_core_seconds(config, cfg, ring, unfused) == 4 * [
        unfused.gemm_fwd_bwd(local, block / 2, d, heads),
        unfused.gemm_fwd_bwd(local, d, block / 2, heads),
    ] + [(merge, merge)]
    # With packed documents the ring is float32 torch ops (`ring_float32`): cp blocks of two
    # float32 GEMMs per head over all of the block's keys, and the ops over its scores.
    documents = apply_layout(
        replace(base, data=replace(base.data, reset_attention_mask=True)), ring
    )
    assert attention_kernel(documents, "flash") == "ring_float32"
    fp32 = Costs(H100, profile, "fp32")
    per_block = [
        fp32.gemm_fwd_bwd(local, block, d, heads),  # QK^T
        fp32.gemm_fwd_bwd(local, d, block, heads),  # probabilities x V
    ]
    passes = (
        (49 * heads * local * s + 2 * local * s * b) / costs.hbm,  # a mask a sequence
        65 * heads * local * s / costs.hbm,
    )
    # (each GEMM's time for the 4 blocks it computes: a sliding layer computes fewer)
    four_blocks = [(forward * 4, backward * 4) for forward, backward in per_block]
    assert attention_core_seconds(documents, cfg, ring, costs) == [*four_blocks, passes]
    assert attention_core_seconds(documents, cfg, ring, unfused) == [*four_blocks, passes]
    # A ring's layer: no s x s term among the element-wise passes, whatever the attention:
    # what the layer takes besides its attention core is the same on both GPUs.
    for at in (config, documents):
        besides = [
            layer_seconds(at, ring, c, 450e9, 450e9, cfg=cfg)["compute"]
            - sum(map(sum, attention_core_seconds(at, cfg, ring, c)))
            for c in (costs, unfused)
        ]
        assert besides[0] == pytest.approx(besides[1])

    config = apply_layout(base, layout)
    unfused_core = [
        unfused.gemm_fwd_bwd(local, s, d, heads),
        unfused.gemm_fwd_bwd(local, d, s, heads),
    ]
    assert attention_kernel(config, "unfused") == "unfused"
    assert attention_core_seconds(config, cfg, layout, unfused) == unfused_core
    fp32_config = replace(config, training=replace(config.training, precision="fp32"))
    assert attention_kernel(fp32_config, "flash") == "unfused"
    assert attention_core_seconds(fp32_config, cfg, layout, fp32) == [
        fp32.gemm_fwd_bwd(local, s, d, heads),
        fp32.gemm_fwd_bwd(local, d, s, heads),
    ]
