"""Context parallelism: the peak CPU memory of a training step at cp 1, 2 and 4; MLA's K/V bytes.

    python benchmarks/bench_context_parallel.py --out bench-results/context_parallel.json
    python benchmarks/bench_context_parallel.py --comm allgather p2p --recompute none selective \
        --out benchmarks/results/context-parallel-cpu.json     # the table in docs/planning.md

A small Llama (2 layers, hidden 1024, 8 heads sharing 2 key/value heads, SwiGLU of 2816,
vocabulary 2048, fp32) trains on one sequence of 8192 tokens a step (micro = global batch
1) at each context-parallel size (one process per CP rank, gloo, dp 1), for each `--comm`
type and `--recompute` mode (by default the all-gather under selective recompute: three
runs, about five minutes on a loaded 2-core machine; the full table, ten runs, 25 minutes
there): `build_run` and `train_step` as `megatrain run` does them, on a synthetic
corpus of random tokens.  Each rank measures its resident set (VmRSS) after building the
run (model, gradient buffers, optimizer: so torch's import, the model and the corpus are
the baseline), then the peak (VmHWM, reset before each step through /proc/self/clear_refs)
of two steps: the first also allocates Adam's moments (after the activations are freed, so
its peak is about the same), the second is the steady state.  Reported per layout: the peak
increase of each step over the resident set before it (MiB, the largest rank's; the ranks
of one layout hold equal shares of the sequence), the steady step against cp 1's at the
same recompute, and `megatrain.plan.memory`'s activation estimate of the layout (what `megatrain
plan` counts; fp32, so twice the 16-bit bytes).

Multi-latent attention's K/V traffic (`mla_cp_traffic`, the record's "mla_kv_traffic"):
one MLA layer forward and backward at cp 2 in gloo with each comm type, the bytes each rank
receives counted from the collectives' tensors, for the tiny test model's attention and
DeepSeek-V3's (kv_lora_rank 512, rope 64, 128 heads, no-rope 128, values 128; bf16), each
count checked against the per-token formula, which then gives DeepSeek-V3's bytes per layer
at its training lengths.  Seconds; `--mla-traffic-only` runs just it:

    python benchmarks/bench_context_parallel.py --mla-traffic-only \
        --out benchmarks/results/context-parallel-mla-traffic.json

glibc is told to give every allocation above 128 KiB its own mapping
(MALLOC_MMAP_THRESHOLD_), so a freed tensor leaves the resident set at once and the
second step's peak is its own, not what the first left in malloc's arenas.
"""

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from megacore.testing import run_distributed

VOCAB, SEQ, LAYERS, HIDDEN, HEADS, GROUPS, FFN = 2048, 8192, 2, 1024, 8, 2, 2816
MIB = 2**20
# Above this many bytes malloc maps each allocation apart and unmaps it when freed.
MMAP_THRESHOLD = 128 * 1024


def _status(field: str) -> int:
    """Bytes of a /proc/self/status field (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """VmHWM back to the current resident set (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def overrides(corpus: str, out: str, cp: int, comm: str, recompute: str, args) -> list[str]:
    return [
        f"data.corpus={corpus!r}",
        f"training.output_dir={out!r}",
        'model.kind="llama"',
        f"model.num_layers={args.layers}",
        f"model.hidden_size={args.hidden}",
        f"model.num_attention_heads={args.heads}",
        f"model.num_query_groups={args.groups}",
        f"model.ffn_hidden_size={args.ffn}",
        f"model.max_position_embeddings={args.seq}",
        f"model.vocab_size={VOCAB}",
        "model.hidden_dropout=0.0",
        "model.attention_dropout=0.0",
        f"model.recompute={recompute!r}",
        f"training.seq_length={args.seq}",
        "training.micro_batch_size=1",
        "training.global_batch_size=1",
        "training.precision='fp32'",
        "training.train_iters=2",
        f"parallel.context_parallel_size={cp}",
        f"parallel.cp_comm_type={comm!r}",
        "logging.tensorboard=false",
    ]


def _rank(config_overrides: list[str]) -> dict:
    from megacore import parallel_state as ps
    from megatrain.config import load_config
    from megatrain.run.distributed import init_distributed
    from megatrain.run.setup import build_run
    from megatrain.run.step import train_step

    config = load_config(None, config_overrides)
    device, _ = init_distributed()
    run = build_run(config, device)
    built = _status("VmRSS")
    steps = []
    for _ in range(2):
        before = _status("VmRSS")
        _reset_peak()
        start = time.perf_counter()
        loss = train_step(run)["loss"]
        steps.append(
            {
                "peak_increase_mib": (_status("VmHWM") - before) / MIB,
                "seconds": time.perf_counter() - start,
                "loss": loss,
            }
        )
    ps.destroy_model_parallel()
    return {
        "resident_after_build_mib": built / MIB,
        "first_step": steps[0],
        "steady_step": steps[1],
    }


def predicted_activations_mib(config_overrides: list[str]) -> float:
    from megatrain.config import load_config
    from megatrain.plan.memory import memory_breakdown

    config = load_config(None, config_overrides)
    return memory_breakdown(config, vocab_size=VOCAB, data_parallel_size=1)["activations"] / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/context_parallel.json"))
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--comm", nargs="+", default=["allgather"], choices=["allgather", "p2p"])
    parser.add_argument(
        "--recompute", nargs="+", default=["selective"], choices=["none", "selective", "full"]
    )
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--groups", type=int, default=GROUPS)
    parser.add_argument("--ffn", type=int, default=FFN)
    parser.add_argument(
        "--mla-traffic-only", action="store_true", help="only MLA's K/V traffic at cp 2"
    )
    args = parser.parse_args()
    started, load_before = time.perf_counter(), os.getloadavg()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # the ranks inherit it

    mla = mla_kv_traffic()
    if args.mla_traffic_only:
        seconds = time.perf_counter() - started
        record = {"benchmark": "context_parallel", "machine": _machine(load_before)}
        _write(args.out, {**record, "mla_kv_traffic": mla, "seconds": seconds})
        return

    from bench_gpt_train import random_docs

    from megatrain.testing import write_corpus

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        corpus = write_corpus(
            Path(tmp) / "corpus",
            {
                "train": [random_docs(rng, 4 * args.seq, VOCAB, 2048)],
                "valid": [random_docs(rng, args.seq, VOCAB, 2048)],
            },
            vocab_size=VOCAB,
        )
        for recompute in args.recompute:
            for cp in args.cp:
                for comm in args.comm if cp > 1 else args.comm[:1]:
                    o = overrides(str(corpus), f"{tmp}/run", cp, comm, recompute, args)
                    ranks = run_distributed(_rank, cp, (o,), timeout=1200, nccl_rules=False)
                    worst = max(ranks, key=lambda r: r["steady_step"]["peak_increase_mib"])
                    row = {
                        "cp": cp,
                        "comm": comm if cp > 1 else None,
                        "recompute": recompute,
                        "tokens_per_rank": args.seq // cp,
                        **worst,
                        "per_rank_steady_peak_mib": [
                            r["steady_step"]["peak_increase_mib"] for r in ranks
                        ],
                        "predicted_activations_mib": predicted_activations_mib(o),
                    }
                    rows.append(row)
                    print(
                        f"recompute {recompute:<9} cp {cp} {row['comm'] or '-':<9} "
                        f"first step +{worst['first_step']['peak_increase_mib']:7.0f} MiB  "
                        f"steady step +{worst['steady_step']['peak_increase_mib']:7.0f} MiB "
                        f"({worst['steady_step']['seconds']:.1f} s)  predicted activations "
                        f"{row['predicted_activations_mib']:7.0f} MiB",
                        flush=True,
                    )
    for row in rows:  # each layout against cp 1 at the same recompute
        one = next(r for r in rows if r["recompute"] == row["recompute"] and r["cp"] == 1)
        row["steady_vs_cp1"] = (
            row["steady_step"]["peak_increase_mib"] / one["steady_step"]["peak_increase_mib"]
        )
    record = {
        "benchmark": "context_parallel",
        "machine": _machine(load_before),
        "model": {
            "kind": "llama",
            "num_layers": args.layers,
            "hidden_size": args.hidden,
            "num_attention_heads": args.heads,
            "num_query_groups": args.groups,
            "ffn_hidden_size": args.ffn,
            "vocab_size": VOCAB,
            "seq_length": args.seq,
            "micro_batch_size": 1,
            "precision": "fp32",
        },
        "method": "peak resident-set increase (VmHWM reset by clear_refs) of a train_step over "
        "the resident set before it, per rank, the largest rank reported; the first step "
        "includes Adam's moments",
        "layouts": rows,
        "mla_kv_traffic": mla,
        "seconds": time.perf_counter() - started,
    }
    _write(args.out, record)


def _machine(load_before) -> dict:
    return {
        "platform": platform.platform(),
        "cpus": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "backend": "gloo",
        "load_average_before_and_after": [load_before, os.getloadavg()],
    }


def _write(out: Path, record: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out} in {record['seconds']:.0f} s")


def mla_kv_traffic() -> dict:
    """MLA's K/V bytes a CP rank receives (`mla_cp_traffic`), counted at cp 2, and
    DeepSeek-V3's per layer from the checked formula at its training lengths."""
    from mla_cp_traffic import SHAPES, measure

    record = measure()
    for row in record["rows"]:
        print(
            f"MLA {row['shape']:<11} cp 2 {row['comm']:<9} forward "
            f"{row['forward_kv_bytes_received']:>10} B received, backward "
            f"{row['backward_kv_grad_bytes_received']:>10} B "
            f"({row['forward_bytes_per_other_token']:.0f} B per other rank's token)",
            flush=True,
        )
    numbers = record["per_token_numbers"]["deepseek-v3"]
    assert SHAPES["deepseek-v3"]["dtype"] == "bfloat16"
    per_layer = []
    for seq in (4096, 32768, 131072):  # V3's pretraining length, its 32K and 128K extensions
        for cp in (2, 8):
            others = seq * (cp - 1) // cp  # tokens of the other ranks, batch 1
            per_layer.append(
                {"seq_length": seq, "cp": cp, "micro_batch": 1,
                 **{f"{kind}_mib": others * n * 2 / 2**20 for kind, n in numbers.items()}}
            )  # fmt: skip
    record["deepseek_v3_forward_bytes_per_layer_bf16"] = per_layer
    record["deepseek_v3_kv_over_latent"] = {
        "unpadded": numbers["kv"] / numbers["latent"],
        "as_gathered_v_padded": numbers["kv_padded"] / numbers["latent"],
    }
    return record


if __name__ == "__main__":
    main()
