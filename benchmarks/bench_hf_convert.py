"""Peak memory and time of `megatrain import-hf` and `export-hf` on generated models: a bf16
Llama and a bf16 Mixtral (experts are most of its bytes) of --size-gb each, in safetensors
shards of --shard-mb, as the Hub publishes them.

    python benchmarks/bench_hf_convert.py --out bench-results/hf_convert.json
    python benchmarks/bench_hf_convert.py --size-gb 4 --out benchmarks/results/hf-convert-4gb.json

Each command runs in a process of its own (the CLI through a wrapper that imports what the
command needs first): its peak is the most resident memory a thread sampling /proc/self/statm
every 5 ms saw while it ran, less the resident memory at the bare start (after the imports),
so the figure is what the conversion itself holds (file pages it maps included).
The models are written a tensor at a time by this script (never held whole) under --dir and
removed after; nothing is committed.  The import reads the sharded files; the export writes
5 GB shards (one file at these sizes) as `export-hf` does by default.  Criterion (issue 59):
the peak under 3x the largest input shard, for both models.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# The wrapper a measured command runs in: the imports first (the bare start), then the CLI.
WRAPPER = """
import resource, sys, json, threading, time
import torch, safetensors.torch, tokenizers, transformers, torch.distributed.checkpoint
import megatrain.cli, megatrain.hf, megatrain.hf.decoder, megatrain.hf.llama, megatrain.hf.moe
import megatrain.checkpoint.convert, megatrain.checkpoint.load
try:
    import megatrain.hf.shards, megatrain.hf.tensor_map  # (a megatrain before them: measured too)
except ImportError:
    pass

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

bare, peak, running = resident(), [0], [True]

def sample():  # resident memory every 5 ms: ru_maxrss would count the imports' own peak
    while running[0]:
        peak[0] = max(peak[0], resident())
        time.sleep(0.005)

sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
try:
    megatrain.cli.main(sys.argv[2:], standalone_mode=False)
finally:
    running[0] = False
    sampler.join()
    with open(sys.argv[1], "w") as f:
        json.dump({"bare": bare, "peak": max(peak[0], resident())}, f)
"""


def llama_config(size_gb: float) -> dict:
    """A Llama 3-like shape (hidden 1024, GQA 16/4, SwiGLU 3584, vocab 32000, untied) with
    as many layers as make `size_gb` of bf16."""
    h, f, vocab = 1024, 3584, 32000
    layer = 2 * h * h + 2 * h * (h // 4) + 3 * h * f + 2 * h
    layers = max(1, round((size_gb * 1e9 / 2 - 2 * vocab * h) / layer))
    return {"model_type": "llama", "hidden_size": h, "intermediate_size": f,
            "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 4,
            "vocab_size": vocab, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "rope_theta": 500000.0, "architectures": ["LlamaForCausalLM"],
            "torch_dtype": "bfloat16"}  # fmt: skip


def mixtral_config(size_gb: float) -> dict:
    """A Mixtral-like shape (hidden 512, 8 experts of 1792, top 2) of `size_gb` of bf16."""
    h, f, vocab, experts = 512, 1792, 32000, 8
    layer = 2 * h * h + 2 * h * (h // 4) + experts * 3 * h * f + experts * h + 2 * h
    layers = max(1, round((size_gb * 1e9 / 2 - 2 * vocab * h) / layer))
    return {"model_type": "mixtral", "hidden_size": h, "intermediate_size": f,
            "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 2,
            "num_local_experts": experts, "num_experts_per_tok": 2, "vocab_size": vocab,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 1e6,
            "architectures": ["MixtralForCausalLM"], "torch_dtype": "bfloat16"}  # fmt: skip


def write_model(root: Path, c: dict, shard_mb: int) -> dict:
    """config.json, a tokenizer of vocab_size words and random bf16 weights in shards of
    `shard_mb`, every tensor made and written one at a time."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from megatrain.hf.decoder import decoder_map
    from megatrain.hf.shards import ShardWriter, plan_shards
    from megatrain.hf.tensor_map import hf_shapes_of

    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(c, indent=2))
    vocab = {f"w{i}": i for i in range(c["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(root / "tokenizer.json"))
    fields = {"model_type": c["model_type"], "layers": c["num_hidden_layers"],
              "hidden": c["hidden_size"], "heads": c["num_attention_heads"],
              "groups": c["num_key_value_heads"],
              "head_dim": c["hidden_size"] // c["num_attention_heads"],
              "ffn": c["intermediate_size"], "vocab": c["vocab_size"], "tied": False,
              "qkv_bias": False, "qk_norm": False}  # fmt: skip
    if c["model_type"] == "mixtral":
        fields |= {"moe_layers": [True] * c["num_hidden_layers"],
                   "experts": c["num_local_experts"], "expert_ffn": c["intermediate_size"],
                   "shared_ffn": None}  # fmt: skip
    shapes = hf_shapes_of(decoder_map(fields, c["vocab_size"]))
    plan = plan_shards(list(shapes.items()), torch.bfloat16, shard_mb * 10**6)
    writer = ShardWriter(root, plan, torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        writer.put(name, 0.02 * torch.randn(shape, generator=generator))
    writer.close()
    files = sorted(root.glob("model*.safetensors"))
    return {
        "bytes": sum(f.stat().st_size for f in files),
        "shards": len(files),
        "largest_shard_bytes": max(f.stat().st_size for f in files),
        "tensors": len(shapes),
        "layers": c["num_hidden_layers"],
    }


def measured(args: list[str], scratch: Path, pythonpath: str | None = None) -> dict:
    """Run `megatrain ARGS` in a process of its own (`pythonpath` first on its path: another
    megatrain's sources, to measure it beside this one): seconds, and its peak RSS above the
    bare start, in bytes."""
    report = scratch / "rss.json"
    env = {**os.environ, "TQDM_DISABLE": "1"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")])
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(report), *args], capture_output=True, text=True,
        env=env,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"megatrain {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    rss = json.loads(report.read_text())
    return {
        "seconds": round(seconds, 2),
        "peak_above_start_bytes": rss["peak"] - rss["bare"],
        "bare_start_bytes": rss["bare"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=0.8)
    parser.add_argument("--shard-mb", type=int, default=150)
    parser.add_argument("--dir", default=None, help="Scratch directory [a temporary one].")
    parser.add_argument("--out", default="bench-results/hf_convert.json")
    parser.add_argument(
        "--measure-pythonpath",
        default=None,
        help="Measure the megatrain on this path instead (e.g. an older checkout's packages/*/src, "
        "joined by ':'); the models are made by this one.",
    )
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-hf-", dir=args.dir))
    results = {}
    try:
        for name, config in (("llama", llama_config), ("mixtral", mixtral_config)):
            root = scratch / name
            model = write_model(root / "hf", config(args.size_gb), args.shard_mb)
            where = args.measure_pythonpath
            imported = measured(["import-hf", str(root / "hf"), "--out", str(root / "ckpt")],
                                scratch, where)  # fmt: skip
            exported = measured(
                ["export-hf", "--ckpt", str(root / "ckpt"), "--out", str(root / "export"),
                 "--dtype", "bfloat16"], scratch, where,
            )  # fmt: skip
            bound = 3 * model["largest_shard_bytes"]
            results[name] = {
                "model": model,
                "import": imported,
                "export": exported,
                "import_peak_over_largest_shard": round(
                    imported["peak_above_start_bytes"] / model["largest_shard_bytes"], 3
                ),
                "export_peak_over_largest_shard": round(
                    exported["peak_above_start_bytes"] / model["largest_shard_bytes"], 3
                ),
                "under_3x_largest_shard": max(imported["peak_above_start_bytes"],
                                              exported["peak_above_start_bytes"]) < bound,
            }  # fmt: skip
            shutil.rmtree(root)
            print(json.dumps({name: results[name]}, indent=2), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = {
        "benchmark": "hf_convert",
        "size_gb": args.size_gb,
        "shard_mb": args.shard_mb,
        "measured_pythonpath": args.measure_pythonpath,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "torch": torch.__version__,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
