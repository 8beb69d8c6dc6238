"""bench_gpu.py's measured tokens/s as rows of the published-runs table, beside the plan.

    python benchmarks/gpu_rows.py gpu.json gpu-llama.json                  # print the rows
    python benchmarks/gpu_rows.py gpu.json --out gpu-rows.toml             # write them
    python benchmarks/gpu_rows.py gpu.json --append \\
        packages/megatrain/src/megatrain/plan/published_runs.toml      # into the table
    python benchmarks/gpu_rows.py gpu.json --check                         # exit 1 if off by > 10%

Each JSON that `benchmarks/bench_gpu.py` wrote becomes one `[[run]]` of
megatrain/plan/published_runs.toml (issue 50, item 4): use "check", source "measured by
benchmarks/bench_gpu.py on <device> <date>", the model and layout from the record's "shape"
(one GPU: tp = pp = dp = 1; the micro batch, sequence, precision, recompute, dropout, compile
and the fused output layer as the run had them), published.value its "megatrain"
tokens_per_s_median; and a second row, "-fp8", of its "megatrain-fp8" measurement (`--fp8`:
the same shape in fp8) where there is one (not skipped, not emulated).
The GPU is the gpus.toml entry whose model (h100, a100, ...) and memory the device's name gives
(`--gpu KEY` where that is not one entry).  Every row is read back by
`megatrain.plan.published.load_runs` (the same checks as the table's rows) and predicted at its
layout (the GPU's profile, or `--profile FILE`, e.g. what `megatrain plan --calibrate` wrote on
the same GPU); the plan beside the measurement is printed, and `--check` fails when one is off by
more than `--tolerance` (issue 50: 10% for the bench's own GPU).
"""

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from megatrain.plan.hardware import load_gpus, load_profile
from megatrain.plan.published import PublishedError, load_runs, predict

TOLERANCE = 0.10  # issue 50: the plan for the bench's one GPU within 10% of it


class RowError(ValueError):
    """A bench record that cannot be a row; the message names the file and the field."""


def gpu_key(device: str, gpus: dict) -> str:
    """The gpus.toml entry of a device named `device` (torch.cuda.get_device_name): the one
    whose model, the key's first part ("h100" of "h100-80gb"), is in the name, and whose
    memory ("80gb") is the name's where the name gives one."""
    name = device.lower()
    # where the name gives the memory ("80GB"), the entry's must be it
    memory = [f"{size}gb" for size in re.findall(r"(?<!\w)(\d+) ?gb", name)]
    matches = [
        key
        for key in gpus
        if key.split("-")[0] in name.replace(" ", "")
        and (not memory or key.split("-", 1)[1] in memory)
    ]
    if len(matches) != 1:
        raise RowError(
            f"device {device!r} is {'none' if not matches else ' or '.join(matches)} of the "
            f"GPU table ({', '.join(gpus)}): pass --gpu KEY"
        )
    return matches[0]


def _value(record: dict, where: str, *path: str):
    value = record
    for key in path:
        if not isinstance(value, dict) or key not in value:
            raise RowError(f"{where}: no {'.'.join(path)} (a bench_gpu.py JSON has it)")
        value = value[key]
    return value


# The measurements of a record that become rows: (its key, the precision it ran, name suffix).
VARIANTS = {"megatrain": (None, ""), "megatrain-fp8": ("fp8", "-fp8")}


def fp8_measured(record: dict) -> bool:
    """Whether a record holds a real (not skipped, not emulated) fp8 measurement."""
    fp8 = record.get("megatrain-fp8")
    return bool(fp8) and not fp8.get("skipped") and "emulated" not in fp8.get("precision", "")


def row(record: dict, source: str, gpu: str, variant: str = "megatrain") -> str:
    """The `[[run]]` TOML of one bench_gpu.py record's `variant` measurement (`source`: the
    file, for `where`)."""
    shape = _value(record, source, "shape")
    ours = _value(record, source, variant)
    if ours.get("skipped"):
        raise RowError(f"{source}: {variant} was skipped ({ours.get('reason')}): no measurement")
    tokens_per_s = _value(record, source, variant, "tokens_per_s_median")
    precision, suffix = VARIANTS[variant]
    precision = precision or shape["precision"]
    if shape.get("num_moe_experts"):
        raise RowError(f"{source}: a mixture of experts; the table's rows are dense models")
    hidden, attention = shape["hidden_dropout"], shape["attention_dropout"]
    if hidden != attention:
        raise RowError(
            f"{source}: shape.hidden_dropout {hidden} and attention_dropout {attention} differ; "
            "a row has one dropout"
        )
    device = _value(record, source, "machine", "device")
    date = _value(record, source, "when")[:10]
    method = record.get("method", {})
    config = Path(shape["config"]).stem
    layers, heads = shape["num_layers"], shape["num_attention_heads"]
    groups = shape.get("num_query_groups")
    name = f"bench-gpu-{config}-{layers}l-1x{gpu}-{date}{suffix}"
    model = [
        f'kind = "{shape["kind"]}"',
        f"layers = {layers}",
        f"hidden = {shape['hidden_size']}",
        f"heads = {heads}",
        *([f"query_groups = {groups}"] if groups and groups != heads else []),
        f"ffn = {shape['ffn_hidden_size']}",
        f"vocab = {shape['vocab_size_padded']}",
        f"dropout = {float(hidden)}",
    ]
    batch = shape["micro_batch_size"]
    layout = [
        f'gpu = "{gpu}"',
        "gpus = 1",
        "tp = 1",
        "pp = 1",
        "dp = 1",
        f"micro_batch = {batch}",
        f"global_batch = {shape['global_batch_size']}",
        f"seq_length = {shape['seq_length']}",
        f'precision = "{precision}"',
        f'recompute = "{shape["recompute"]}"',
        'sharding = "none"',
        "fused_linear_cross_entropy = "
        + str(bool(shape.get("levers", {}).get("fused_linear_cross_entropy"))).lower(),
        f"compile = {str(bool(shape.get('compile'))).lower()}",
    ]
    steps = method.get("timed_steps")
    where = (
        f"{Path(source).name}: {variant}.tokens_per_s_median"
        + (f" of {steps} timed steps after {method.get('warmup_steps')}" if steps else "")
        + f"; model and layout from its shape ({shape['config']}, {layers} layers)"
    )
    return "\n".join(
        [
            "[[run]]",
            f'name = "{name}"',
            'use = "check"',
            f"source = {json.dumps(f'measured by benchmarks/bench_gpu.py on {device} {date}')}",
            f"where = {json.dumps(where)}",
            "[run.model]",
            *model,
            "[run.layout]",
            *layout,
            "[run.published]",
            'metric = "tokens_per_s_per_gpu"',
            f"value = {float(tokens_per_s):.1f}",
            'definition = "tokens per second of the median timed step, one GPU (bench_gpu.py)"',
        ]
    )


def rows(paths: list[Path], gpu: str | None = None) -> str:
    """The rows of bench_gpu.py JSON files, as TOML."""
    gpus = load_gpus()
    if gpu is not None and gpu not in gpus:
        raise RowError(f"--gpu {gpu!r}: not a GPU of the table ({', '.join(gpus)})")
    out = []
    for path in paths:
        if not path.is_file():
            raise RowError(f"{path}: no such file (a bench_gpu.py --out JSON)")
        record = json.loads(path.read_text())
        key = gpu or gpu_key(_value(record, str(path), "machine", "device"), gpus)
        out.append(row(record, str(path), key))
        if fp8_measured(record):
            out.append(row(record, str(path), key, "megatrain-fp8"))
    return "\n\n".join(out) + "\n"


def checked(text: str, profile_path: str | None) -> list[tuple]:
    """Each row of `text` read by load_runs and predicted: (run, the plan's tokens/s, ratio)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.toml"
        path.write_text(text)
        runs = load_runs(path)
    profile = load_profile(profile_path) if profile_path else None
    out = []
    for run in runs:
        value, _ = predict(run, profile)
        out.append((run, value, value / run.value))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", type=Path, help="bench_gpu.py --out files")
    parser.add_argument("--gpu", help="the gpus.toml entry (default: from the device's name)")
    parser.add_argument("--profile", help="a profile file to predict with (default: the GPU's)")
    parser.add_argument("--out", type=Path, help="write the rows here (default: print them)")
    parser.add_argument("--append", type=Path, help="append the rows to this runs table")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when a row's plan is off by more"
    )
    args = parser.parse_args(argv)
    try:
        text = rows(args.json, args.gpu)
        results = checked(text, args.profile)
    except (RowError, PublishedError) as e:
        print(f"gpu_rows: {e}", file=sys.stderr)
        return 2
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    if args.append:
        before = args.append.read_text()
        args.append.write_text(before.rstrip("\n") + "\n\n" + text)
        try:
            load_runs(args.append)
        except PublishedError as e:  # a name twice, say: the table as it was
            args.append.write_text(before)
            print(f"gpu_rows: not appended to {args.append}: {e}", file=sys.stderr)
            return 2
        print(f"appended {len(results)} rows to {args.append}")
    if not args.out and not args.append:
        print(text)
    off = 0
    for run, value, ratio in results:
        within = abs(ratio - 1) <= args.tolerance
        off += not within
        print(
            f"{run.name}: measured {run.value:.0f} tokens/s, plan {value:.0f}, ratio {ratio:.2f} "
            f"({'within' if within else 'off by more than'} {args.tolerance:.0%})"
        )
    return 1 if args.check and off else 0


if __name__ == "__main__":
    sys.exit(main())
