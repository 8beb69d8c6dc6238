"""benchmarks/bench_gpu.py on a CPU at a tiny shape: ours and HF train on the same batches, the
record says when it was made, and a peer that cannot run is recorded as skipped with its reason
while the others' numbers stay.

The run blocks the peers' packages itself, so it is the same where they are installed: one as
not installed (megatron-core), one as installed but failing in its runner (torchtitan).  Where
they are installed, a second test trains both at the same tiny shape.
"""

import importlib.util
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--small", "--iters", "2", "--warmup", "1", "--layers", "2", "--hidden", "64", "--heads",
        "2", "--seq", "64", "--vocab", "512", "--peak-tflops", "1"]  # fmt: skip
# bench_gpu.py as `python benchmarks/bench_gpu.py ARGS` runs it, with megatron-core not
# importable and torchtitan importable but its runner raising.
BLOCKED_PEERS = """
import runpy, sys, types
sys.path.insert(0, "benchmarks")
sys.modules["megatron"] = None
sys.modules["torchtitan"] = types.ModuleType("torchtitan")
runner = sys.modules["peers.torchtitan"] = types.ModuleType("peers.torchtitan")
def build(*args, **kwargs):
    raise RuntimeError("a runner that breaks")
runner.build = build
sys.argv = ["benchmarks/bench_gpu.py", *sys.argv[1:]]
runpy.run_path("benchmarks/bench_gpu.py", run_name="__main__")
"""


def bench(tmp_path: Path, *args: str, code: str | None = None) -> dict:
    out = tmp_path / "gpu.json"
    launch = ["-c", code] if code else ["benchmarks/bench_gpu.py"]
    cmd = [sys.executable, *launch, *TINY, *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_ours_and_hf_are_recorded_and_peers_that_cannot_run_are_skipped_with_a_reason(tmp_path):
    graphs = ["--cuda-graphs", "--recompute", "none"]  # graphs refuse recompute
    record = bench(
        tmp_path, "--fp8-emulate", "--profile", "--packed", "--fsdp", *graphs, code=BLOCKED_PEERS
    )
    # Ours with CUDA graphs cannot run on a CPU: recorded as skipped, saying why.
    graphs = record["megatrain-cuda-graphs"]
    assert graphs["skipped"] and "cuda_graphs = true needs a CUDA device" in graphs["reason"]
    datetime.fromisoformat(record["when"])
    # Ours again in fp8 (torchao's emulation here), its loss beside ours in the JSON.
    fp8 = record["megatrain-fp8"]
    assert "skipped" not in fp8, fp8.get("reason")
    assert fp8["precision"].startswith("fp8") and len(fp8["losses"]) == 3
    assert 0 < fp8["loss_check"]["max_abs_diff_vs_megatrain"] < 0.1
    assert all(record["shape"]["levers"].values())  # ours ran with the speed levers
    # Ours again fully sharded by FSDP2 (one rank, fp32 here): the plain step's losses.
    fsdp = record["megatrain-fsdp"]
    assert "skipped" not in fsdp, fsdp.get("reason")
    assert fsdp["loss_check"]["max_abs_diff_vs_megatrain"] < 1e-4
    # Ours again with packed documents (SDPA's document mask here, FlexAttention on CUDA).
    packed = record["megatrain-packed"]
    assert "skipped" not in packed, packed.get("reason")
    # Its documents are longer than the benchmark's sequences: near ours, on the same batches.
    assert (
        packed["batches_checked"] == 3 and packed["loss_check"]["max_abs_diff_vs_megatrain"] < 0.1
    )
    # The profiled step names the SDPA backend that ran and the share of the step in matmuls
    # and attention: here the math one (the CPU's flash kernel takes no dropout; the config's
    # is 0.1), whose products count as matmuls.
    kernels = record["megatrain"]["profile_kernels"]
    assert kernels["sdpa_backends"] == ["math"], kernels
    assert 0 < kernels["attention_share"] < kernels["matmul_and_attention_share"] < 1, kernels
    for name in ("megatrain", "hf"):
        r = record[name]
        assert len(r["losses"]) == 3 and r["batches_checked"] == 3 and r["tokens_per_s_median"] > 0
        assert r["loss_check"]["first_loss_near_ln_vocab"], r["losses"]
    assert record["hf"]["loss_check"]["max_abs_diff_vs_megatrain"] < 0.2
    missing, broken = record["megatron-core"], record["torchtitan"]
    assert missing["skipped"] and "megatron.core does not import" in missing["reason"]
    assert broken["skipped"] and broken["reason"] == "failed: RuntimeError: a runner that breaks"


@pytest.mark.skipif(
    not (importlib.util.find_spec("megatron") and importlib.util.find_spec("torchtitan")),
    reason="megatron-core and torchtitan are not installed (scripts/fetch_gpu_wheels.py)",
)
def test_peers_train_on_our_batches_where_installed(tmp_path):
    record = bench(tmp_path, "--no-hf")
    for name in ("megatron-core", "torchtitan"):
        r = record[name]
        assert "skipped" not in r, r.get("reason")
        assert len(r["losses"]) == 3 and r["batches_checked"] == 3
        assert r["loss_check"]["first_loss_near_ln_vocab"], r["losses"]
    assert record["megatron-core"]["parameters"] == record["megatrain"]["parameters"]
    assert record["megatron-core"]["loss_check"]["max_abs_diff_vs_megatrain"] < 0.2


def test_a_deepseek_shape_runs_beside_hf(tmp_path):
    """The DeepSeek shapes (here the shipped deepseek-tiny cut to 2 layers: its dense first
    layer kept, multi-latent attention, group-limited routing) beside transformers'
    DeepseekV3ForCausalLM, without the MTP depth that HF drops."""
    config = ROOT / "pipelines" / "models" / "deepseek-tiny.toml"
    record = bench(tmp_path, "--config", str(config), "--peers", "none")
    assert record["hf"]["class"] == "DeepseekV3ForCausalLM"
    assert record["shape"]["multi_latent_attention"] and record["shape"]["mtp_num_layers"] is None
    for name in ("megatrain", "hf"):
        r = record[name]
        assert len(r["losses"]) == 3 and r["batches_checked"] == 3 and r["tokens_per_s_median"] > 0
        assert r["loss_check"]["first_loss_near_ln_vocab"], r["losses"]
    assert record["hf"]["loss_check"]["max_abs_diff_vs_megatrain"] < 0.2


def test_a_gpt_oss_shape_runs_beside_hf(tmp_path):
    """gpt-oss (the shipped gpt-oss-tiny cut to 2 layers: its alternation of a sliding layer
    and a full one kept, the window of 16 shorter than the 64 tokens, sinks, biased clamped
    experts) beside transformers' GptOssForCausalLM: the windowed case bench_gpu.py times on a
    GPU (FlexAttention's block mask) when one is lent."""
    config = ROOT / "pipelines" / "models" / "gpt-oss-tiny.toml"
    record = bench(tmp_path, "--config", str(config), "--peers", "none")
    assert record["hf"]["class"] == "GptOssForCausalLM"
    shape = record["shape"]
    assert shape["layer_types"] == ["sliding_attention", "full_attention"]
    assert shape["window_size"] < shape["seq_length"] and shape["softmax_type"] == "learnable"
    for name in ("megatrain", "hf"):
        r = record[name]
        assert len(r["losses"]) == 3 and r["batches_checked"] == 3 and r["tokens_per_s_median"] > 0
        assert r["loss_check"]["first_loss_near_ln_vocab"], r["losses"]
