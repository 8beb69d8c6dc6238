"""What a run reports: throughput, TFLOP/s, MFU and HFU, log lines, TensorBoard, a loss plot.

Only global rank 0 writes.  TFLOP/s and MFU (model FLOPs utilisation) use the model FLOPs,
72 B s l h^2 (1 + s/6h + V/12lh) per iteration whatever is recomputed
(`megatrain.plan.accounting.flops_per_iteration`, GPT's here); HFU (hardware FLOPs utilisation)
adds the recomputed work (its hardware FLOPs: 96 B s l h^2 (1 + s/6h + V/16lh) under
full recompute, the attention cores again under selective, = MFU without).  The peak is one
device's dense bf16/fp16 tensor rate from the table below, or, on a CPU, the rate of a
large fp32 matrix multiply measured at start (no vendor number applies to an
arbitrary CPU).  `logging.peak_tflops` overrides both.
"""

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megacommon.progress import duration

if TYPE_CHECKING:  # imported where used: reading a log (demo_summary) needs no torch
    import torch

# Dense (not sparse) bf16/fp16 tensor-core peak, TFLOP/s, from the vendors' data sheets.
# First match wins, so the specific names come before the general ones.
PEAK_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("GH200", 989.4),
    ("H800", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("V100", 125.0),
    ("T4", 65.0),
]


def measured_matmul_tflops(size: int = 2048, warmup: int = 2, repeats: int = 6) -> float:
    """The best fp32 rate of a size^3 matrix multiply on the CPU with this process's threads.

    The best of several after a warm-up: a first call is often slow (thread pool, page faults)
    and a shared machine adds noise, both of which would inflate the MFU.
    """
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(warmup):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def device_peak_tflops(device: "torch.device", override: float | None = None) -> tuple[float, str]:
    """(peak TFLOP/s of one device, where the number comes from)."""
    import torch

    if override is not None:
        return override, "logging.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in PEAK_TFLOPS:
            if key in name:
                return peak, f"{name}, dense bf16/fp16"
        raise ValueError(
            f"no peak TFLOP/s known for GPU {name!r}; set logging.peak_tflops=<dense bf16 TFLOP/s>"
        )
    threads = torch.get_num_threads()
    return (
        measured_matmul_tflops(),
        f"CPU fp32 matmul measured with {threads} thread{'s' if threads > 1 else ''}",
    )


def format_line(record: dict) -> str:
    """One log line: `iteration 10/100 | loss 5.123 | lr 1.5e-04 | ...`."""
    parts = [f"iteration {record['iteration']}/{record['train_iters']}"]
    fmt = {
        "loss": "loss {:.4f}",
        "mlm_loss": "MLM {:.4f}",
        "sop_loss": "SOP {:.4f}",
        "sop_accuracy": "SOP acc {:.1%}",
        "lr": "lr {:.3e}",
        "grad_norm": "grad norm {:.3f}",
        "loss_scale": "loss scale {:.0f}",
        "skipped": "skipped {}",
        "ms_per_iter": "{:.0f} ms/it",
        "tokens_per_s": "{:.0f} tokens/s",
        "tflops": "{:.3g} TFLOP/s/device",
        "mfu": "MFU {:.1%}",
        "hfu": "HFU {:.1%}",
        "moe_aux_loss": "aux loss {:.3f}",
        "valid_loss": "valid loss {:.4f}",
        "valid_mlm_loss": "valid MLM {:.4f}",
        "valid_sop_loss": "valid SOP {:.4f}",
        "valid_sop_accuracy": "valid SOP acc {:.1%}",
        "valid_ppl": "valid ppl {:.2f}",
    }
    for key, pattern in fmt.items():
        if record.get(key) is not None:
            parts.append(pattern.format(record[key]))
        if key in ("loss", "valid_loss"):  # multi-token prediction's depths after the LM loss
            prefix, label = key.replace("loss", "mtp_loss/depth"), key.replace("_", " ")[:-4]
            parts += [
                f"{label}MTP{name.removeprefix(prefix)} {value:.4f}"
                for name, value in record.items()
                if name.startswith(prefix) and value is not None
            ]
    if record.get("moe_load"):  # the least balanced MoE layer (each layer's in log.jsonl)
        parts.append(f"expert load max/mean {max(record['moe_load'].values()):.2f}")
    if record.get("moe_dropped"):
        parts.append(f"dropped {max(record['moe_dropped'].values()):.1%}")
    if record.get("elapsed_s") is not None:
        parts.append(f"elapsed {duration(record['elapsed_s'])}")
    if record.get("eta_s") is not None and record["iteration"] < record["train_iters"]:
        parts.append(f"ETA {duration(record['eta_s'])}")
    return " | ".join(parts)


class RunLog:
    """Lines to stdout, records to `<output>/log.jsonl`, scalars to TensorBoard (rank 0 only)."""

    def __init__(self, output_dir: str | Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.writer = None
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = (self.output_dir / "log.jsonl").open("a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.output_dir / "tensorboard"))

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def record(self, record: dict) -> None:
        if not self.enabled:
            return
        print(format_line(record), flush=True)
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for key, value in record.items():
                if key in ("iteration", "train_iters"):
                    continue
                # A dict (a blend's samples per corpus) as one scalar per entry: key/name.
                items = value.items() if isinstance(value, dict) else [(None, value)]
                for name, v in items:
                    if isinstance(v, (int, float)):
                        tag = key.replace("valid_", "valid/") + (f"/{name}" if name else "")
                        self.writer.add_scalar(tag, v, record["iteration"])
            self.writer.flush()

    def close(self) -> Path | None:
        """Write the loss plot; return its path."""
        if not self.enabled:
            return None
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()
        train, valid = curves_from_log(self.output_dir / "log.jsonl")
        return plot_losses(train, valid, self.output_dir / "loss.png")


def curves_from_log(path: Path) -> tuple[list, list]:
    """(iteration, loss) of train and valid from a log.jsonl, over every session of a run
    that was resumed; an iteration logged twice (redone after a restart) counts once, last."""
    train, valid = {}, {}
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if record.get("loss") is not None:
            train[record["iteration"]] = record["loss"]
        if record.get("valid_loss") is not None:
            valid[record["iteration"]] = record["valid_loss"]
    return sorted(train.items()), sorted(valid.items())


def plot_losses(train: list, valid: list, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on a cluster node
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", linewidth=1.2)
    if valid:
        ax.plot(*zip(*valid, strict=True), "o-", label="valid loss", linewidth=1.2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
