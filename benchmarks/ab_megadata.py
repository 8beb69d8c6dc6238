"""megadata's whole recipe, this checkout against another (or against itself on another
number of workers), runs interleaved: medians.

    python benchmarks/ab_megadata.py --other /path/to/other/checkout --out ab.json
    python benchmarks/ab_megadata.py --workers 2 --other-workers 1 --out scaling.json

This VM's speed drifts by 30% between minutes and by 2x between days, so one run of each
code compares nothing.  Here the bench corpora of bench_megadata.py (`--mb` MB of text,
made once) go through the whole recipe (`--workers`, every stage from scratch) with the
other checkout's megadata, then with this one's, corpus after corpus, `--rounds` times;
each run is a fresh process, and the JSON keeps every run's stage rows and, per code and
corpus, the median wall and CPU seconds and MB/s per core (by wall time x workers and by
CPU time).  `--other` is a checkout (a `git worktree add DIR COMMIT` will do) whose
`packages/megadata/src` is put first on the path of its runs; without it, the "other" runs
are this checkout's with `--other-workers` workers, which tells what a second worker buys
on this machine.  The summary also keeps each stage's median wall and CPU seconds.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ONE_RUN = """
import json, sys
from pathlib import Path
sys.path.insert(0, {bench!r})
from megadata_corpora import bench_recipe
from megadata.recipe import cluster_start, load_recipe, run_recipe
recipe = load_recipe(bench_recipe({kind!r}, {mb!r}, Path({work!r})), output=Path({out!r}))
stages = run_recipe(recipe, workers={workers!r}, progress=False)
start = cluster_start(recipe)
rows = ([start] if start else []) + stages
print(json.dumps({{
    "text_mb": stages[0].bytes_out / 1e6,  # ingest's output: the corpus' text
    "stages": [
        {{"stage": r.stage, "seconds": round(r.seconds, 2), "cpu_seconds": round(r.cpu_seconds, 2)}}
        for r in rows
    ],
}}))
"""


def run_once(src: Path | None, kind: str, mb: float, workers: int, work: Path) -> dict:
    out = work / f"corpus-{kind}"
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src) + os.pathsep + env.get("PYTHONPATH", "")
    code = ONE_RUN.format(
        bench=str(HERE), kind=kind, mb=mb, work=str(work / kind), out=str(out), workers=workers
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise SystemExit(f"a {kind} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _stage_medians(runs: list[dict]) -> dict:
    """{stage: [median wall seconds, median CPU seconds]} over the runs."""
    names = [s["stage"] for s in runs[0]["stages"]]
    return {
        name: [
            statistics.median(s[key] for x in runs for s in x["stages"] if s["stage"] == name)
            for key in ("seconds", "cpu_seconds")
        ]
        for name in names
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--other", type=Path, help="the checkout to compare with (default: this)")
    parser.add_argument("--other-workers", type=int, help="workers of the other runs (--workers)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mb", type=float, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--corpora", nargs="+", default=["default", "bert", "jsonl"])
    parser.add_argument("--out", type=Path, default=Path("bench-results/megadata-ab.json"))
    args = parser.parse_args()
    other_workers = args.other_workers or args.workers
    if args.other is None and other_workers == args.workers:
        raise SystemExit("give --other CHECKOUT, or --other-workers N other than --workers")
    other_src = None
    if args.other is not None:
        other_src = args.other.resolve() / "packages/megadata/src"
        if not (other_src / "megadata").is_dir():
            raise SystemExit(f"--other {args.other}: no packages/megadata/src/megadata there")
    codes = {"other": (other_src, other_workers), "this": (None, args.workers)}
    runs = []
    with tempfile.TemporaryDirectory(prefix="megadata-ab-") as tmp:
        for r in range(args.rounds):
            for kind in args.corpora:
                for name, (src, workers) in codes.items():
                    got = run_once(src, kind, args.mb, workers, Path(tmp))
                    wall = sum(s["seconds"] for s in got["stages"])
                    cpu = sum(s["cpu_seconds"] for s in got["stages"])
                    runs.append({"round": r, "code": name, "corpus": kind, **got})
                    line = f"round {r} {kind:8s} {name:5s} wall {wall:6.1f} cpu {cpu:6.1f}"
                    print(line, flush=True)
    summary = {}
    for kind in args.corpora:
        for name, (_, workers) in codes.items():
            mine = [x for x in runs if x["corpus"] == kind and x["code"] == name]
            wall = statistics.median(sum(s["seconds"] for s in x["stages"]) for x in mine)
            cpu = statistics.median(sum(s["cpu_seconds"] for s in x["stages"]) for x in mine)
            text_mb = mine[0]["text_mb"]
            summary.setdefault(kind, {})[name] = {
                "workers": workers,
                "median_seconds": round(wall, 2),
                "median_cpu_seconds": round(cpu, 2),
                "mb_per_s_per_core_wall": round(text_mb / wall / workers, 3),
                "mb_per_s_per_core_cpu": round(text_mb / cpu, 3),
                "stages": _stage_medians(mine),
            }
    result = {
        "other": str(args.other.resolve()) if args.other else "this checkout",
        "rounds": args.rounds,
        "workers": args.workers,
        "other_workers": other_workers,
        "mb": args.mb,
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
