"""The paper's Figure 7, small: BERT's original block order (a, post_ln) against the reordered
one (b, pre_ln) as the model deepens.

    make fig7                                     # the bundled BERT corpus, CPU-sized runs
    python benchmarks/bench_fig7.py --corpus data/corpus/default-bert --out bench-results/fig7

Four runs of `megatrain.run.loop.train` in this process (one rank): both block orders at a
shallow and a deep size (`--layers 4 24`), same data, seed, batch and learning rate
(`--lr`, higher than BERT's 1e-4 so that a small budget can show the instability the paper
reports for (a) as it grows).  Writes `fig7.json` (each run's settings, training losses,
validation losses, final losses) and `fig7.png` (training loss against iteration, the four
runs), and prints a table.  Whatever the curves show is the result: nothing here is
tuned to make (b) win.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_gpt_train import free_port

from megatrain.config import load_config
from megatrain.run.loop import train

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "pipelines" / "models" / "bert-tiny.toml"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=ROOT / "data" / "corpus" / "default-bert")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "fig7")
    parser.add_argument("--layers", type=int, nargs=2, default=[4, 24], metavar=("SHALLOW", "DEEP"))
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    return parser.parse_args()


def overrides(args, order: str, layers: int, out: Path) -> list[str]:
    return [
        f"model.block_order={order!r}",
        f"model.num_layers={layers}",
        f"model.hidden_size={args.hidden}",
        f"model.num_attention_heads={args.heads}",
        f"model.max_position_embeddings={args.seq}",
        f"training.seq_length={args.seq}",
        f"training.micro_batch_size={args.batch}",
        f"training.global_batch_size={args.batch}",
        f"training.train_iters={args.iters}",
        f"training.eval_interval={max(1, args.iters // 6)}",
        "training.eval_iters=4",
        f"training.seed={args.seed}",
        f"optimizer.lr={args.lr}",
        f"optimizer.min_lr={args.lr / 100}",
        f"optimizer.lr_warmup_iters={args.warmup}",
        f"data.corpus={str(args.corpus)!r}",
        f"training.output_dir={str(out)!r}",
        "logging.tensorboard=false",
        f"logging.log_interval={max(1, args.iters // 10)}",
    ]


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in runs.items():
        style = "-" if run["block_order"] == "pre_ln" else "--"
        ax.plot(range(1, len(run["loss"]) + 1), run["loss"], style, label=name, linewidth=1)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (MLM + SOP)")
    ax.set_title("BERT block order as depth grows (paper Fig. 7, small)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    if not (args.corpus / "manifest.json").is_file():
        raise SystemExit(
            f"{args.corpus}: no BERT corpus there; build the bundled one with "
            "`make data RECIPE=default-bert`"
        )
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}"
    )
    runs = {}
    try:
        for layers in args.layers:
            for order, label in (("post_ln", "a"), ("pre_ln", "b")):
                name = f"({label}) {order}, {layers} layers"
                start = time.perf_counter()
                out = args.out / f"{order}-{layers}"
                history = train(load_config(TINY, overrides(args, order, layers, out)))
                runs[name] = {
                    "block_order": order,
                    "layers": layers,
                    "loss": history["loss"],
                    "mlm_loss": history["mlm_loss"],
                    "sop_loss": history["sop_loss"],
                    "valid": history["valid"],
                    "final_loss": sum(history["loss"][-10:]) / len(history["loss"][-10:]),
                    "final_valid_loss": history["valid"][-1][1],
                    "seconds": time.perf_counter() - start,
                }
                print(f"{name}: final loss {runs[name]['final_loss']:.3f}", flush=True)
    finally:
        dist.destroy_process_group()
    settings = {k: v for k, v in vars(args).items() if k not in ("corpus", "out")}
    record = {"benchmark": "fig7", "corpus": str(args.corpus), "settings": settings, "runs": runs}
    (args.out / "fig7.json").write_text(json.dumps(record, indent=2) + "\n")
    plot(runs, args.out / "fig7.png")
    print(f"\n  {'run':28s} {'final train loss':>16s} {'final valid loss':>16s}")
    for name, run in runs.items():
        print(f"  {name:28s} {run['final_loss']:16.3f} {run['final_valid_loss']:16.3f}")
    print(f"wrote {args.out / 'fig7.json'} and {args.out / 'fig7.png'}")


if __name__ == "__main__":
    main()
