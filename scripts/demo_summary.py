"""The table `make demo` ends with: training, WikiText-style perplexity and LAMBADA-style
accuracy of the demo model on documents the corpus recipe held out of training."""

import argparse
import json
import math
import sys
from pathlib import Path

from megatrain.run.metrics import curves_from_log


def _read(path: Path) -> dict:
    if not path.is_file():
        sys.exit(f"demo_summary: {path} is missing; did the step that writes it fail?")
    return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True, type=Path, help="The demo's output directory.")
    args = parser.parse_args()
    run = args.dir / "run"
    train, valid = curves_from_log(run / "log.jsonl")
    wiki = _read(args.dir / "wikitext103.json")
    strict = _read(args.dir / "lambada.json")
    loose = _read(args.dir / "lambada-nonstrict.json")
    rows = [
        ("training steps", f"{train[-1][0]}" if train else "n/a"),
        ("train loss, first -> last", f"{train[0][1]:.3f} -> {train[-1][1]:.3f}" if train else ""),
        (
            "valid loss (ppl), last",
            f"{valid[-1][1]:.3f} ({math.exp(valid[-1][1]):.1f})" if valid else "",
        ),
        ("held-out WikiText: T_o / T", f"{wiki['T_o']} words / {wiki['T']} tokens"),
        ("  mean loss, ppl", f"{wiki['mean_loss']:.3f}, {wiki['ppl']:.2f}"),
        ("  adjusted (word-level) ppl", f"{wiki['adjusted_ppl']:.2f}"),
        ("held-out LAMBADA: passages", f"{strict['examples']}"),
        ("  accuracy strict / last token", f"{strict['accuracy']:.1%} / {loose['accuracy']:.1%}"),
        ("  target ppl (strict)", f"{strict['target_ppl']:.2f}"),
        ("loss plot", str(run / "loss.png")),
    ]
    width = max(len(name) for name, _ in rows)
    print("\nmake demo: summary")
    print("-" * (width + 40))
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
