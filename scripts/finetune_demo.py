"""`make finetune-demo`: a tiny BERT pretrained on the bundled corpus, fine-tuned on real task
rows (`make finetune-data`), with a summary table like the main demo's.

1. Pretrain (or reuse) `pipelines/models/bert-tiny.toml` on the bundled BERT corpus
   (`megatrain run`, which resumes a run cut short and does nothing for a finished one).
2. SQuAD 1.1: score the pretrained model as it is (`megaeval finetune squad1 --eval-only`: the
   span head from its seed, no fine-tuning), then fine-tune it on MLQA's English SQuAD 1.1
   training file and score it on XQuAD's English dev questions.
3. MNLI, QQP, SQuAD 2.0 (CUAD) and RACE end to end on their samples.

The tiny model knows 128 positions, so every task runs at --max-seq-length 128 (SQuAD's
windows of 128 tokens, RACE's passages cut to fit), and the batch sizes and learning rates are
the tiny model's, not Table 6's (which are for 336M parameters and more); each is printed with
the command.  A step whose results are newer than the pretrained checkpoint is reused, not
run again.  Writes DIR/summary.json; each task's metrics, predictions, log and loss plot are
under DIR/TASK/.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from megatrain.run.metrics import curves_from_log

# name -> (task, what it shows, extra `megaeval finetune` options).
JOBS = {
    "squad1-before": ("squad1", "SQuAD 1.1, not fine-tuned", ["--eval-only"]),
    "squad1": (
        "squad1",
        "SQuAD 1.1, fine-tuned",
        ["--batch-size", "8", "--micro-batch-size", "8", "--lr", "5e-4", "--epochs", "3"],
    ),
    "mnli": ("mnli", "MNLI", ["--batch-size", "3", "--micro-batch-size", "3", "--epochs", "2"]),
    "qqp": ("qqp", "QQP", ["--batch-size", "3", "--micro-batch-size", "3", "--epochs", "2"]),
    "squad2": (
        "squad2",
        "SQuAD 2.0 (CUAD)",
        ["--batch-size", "32", "--micro-batch-size", "32", "--lr", "1e-3", "--epochs", "1"],
    ),
    "race": ("race", "RACE", ["--batch-size", "4", "--lr", "1e-4", "--epochs", "2"]),
}
SEQ = "128"


def _run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode != 0:
        sys.exit(f"finetune_demo: this step failed: {' '.join(cmd)}")


def _fresh(out: Path, marker: str, since: Path) -> bool:
    """Whether `out` finished after the checkpoint `since` was last written."""
    done = out / marker
    return done.is_file() and since.is_file() and done.stat().st_mtime > since.stat().st_mtime


def _metrics_row(task: str, metrics: dict) -> str:
    keys = {
        "mnli": ["accuracy"],
        "qqp": ["accuracy", "f1"],
        "race": ["all", "middle", "high"],
        "squad1": ["exact_match", "f1"],
        "squad2": ["exact", "f1", "HasAns_f1", "NoAns_f1"],
    }[task]
    shown = []
    for split, values in metrics.items():
        if not isinstance(values, dict):
            continue
        parts = [f"{k} {values[k]:.2f}" for k in keys if isinstance(values.get(k), float)]
        shown.append(f"{split}: {', '.join(parts)}")
    return "; ".join(shown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("runs/finetune-demo"))
    parser.add_argument("--data", type=Path, default=Path("data/finetune"))
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus/default-bert"))
    parser.add_argument("--config", default="pipelines/models/bert-tiny.toml")
    parser.add_argument("--bin", type=Path, default=Path(sys.executable).parent)
    args = parser.parse_args()
    inputs = {
        args.data / "SOURCES.json": "make finetune-data",
        args.corpus / "manifest.json": "make data RECIPE=default-bert",
    }
    for needed, how in inputs.items():
        if not needed.is_file():
            sys.exit(f"finetune_demo: no {needed}; run `{how}` first")
    ckpt = args.dir / "bert"
    seconds = {}
    start = time.perf_counter()
    _run([
        str(args.bin / "megatrain"), "run", "--config", args.config,
        f'training.output_dir="{args.dir / "pretrain"}"', f'data.corpus="{args.corpus}"',
        "--save", str(ckpt), "--load", str(ckpt),
    ])  # fmt: skip
    seconds["pretrain"] = time.perf_counter() - start
    latest = ckpt / "latest"
    for name, (task, _, extra) in JOBS.items():
        out = args.dir / name
        marker = "metrics.json" if "--eval-only" in extra else "settings.json"
        if _fresh(out, marker, latest):
            print(f"finetune_demo: {name}: reused {out} (newer than {latest})", flush=True)
            continue
        start = time.perf_counter()
        _run([
            str(args.bin / "megaeval"), "finetune", task, "--ckpt", str(ckpt),
            "--data", str(args.data / task), "--out", str(out), "--max-seq-length", SEQ, *extra,
        ])  # fmt: skip
        seconds[name] = time.perf_counter() - start

    rows, record = [], {}
    for name, (task, label, _) in JOBS.items():
        out = args.dir / name
        metrics = json.loads((out / "metrics.json").read_text())
        train = curves_from_log(out / "log.jsonl")[0] if (out / "log.jsonl").is_file() else []
        # Means over the first and the last tenth of the steps (1 to 10 of them): one step's
        # loss is noisy at these batch sizes.
        k = max(1, min(10, len(train) // 10))
        first = sum(x for _, x in train[:k]) / k if train else None
        last = sum(x for _, x in train[-k:]) / k if train else None
        loss = f"{first:.3f} -> {last:.3f}" if train else "(no training)"
        rows.append((label, f"{len(train)}", loss, _metrics_row(task, metrics)))
        record[name] = {
            "task": task,
            "steps": len(train),
            "loss_first_steps": first,
            "loss_last_steps": last,
            "steps_averaged": k if train else 0,
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, dict)},
            "seconds": round(seconds[name], 1) if name in seconds else "reused",
        }
    record["pretrain_seconds"] = round(seconds["pretrain"], 1)
    (args.dir / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
    header = ("task", "steps", "train loss, first -> last", "dev (official scoring)")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(3)]
    print("\nmake finetune-demo: summary (a 4-layer BERT of hidden 128 on sample rows)")
    print("-" * (sum(widths) + 50))
    for row in [header, *rows]:
        print("  ".join(f"{row[i]:<{widths[i]}}" for i in range(3)) + "  " + row[3])
    print("train loss: the mean over the first and the last tenth of the steps (at most 10)")
    print(f"per task: {args.dir}/TASK/ (metrics.json, predictions, log.jsonl, loss.png)")


if __name__ == "__main__":
    main()
