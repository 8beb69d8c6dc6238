"""Where each of our tensors lies in a Hugging Face model's files, as boxes: the one description
that import, export and `megatrain run --load-hf` all read, so none of them holds a model.

Our global tensor (`Target`, at its global shape) is a set of rectangular boxes (`Source`), each
a box of one HF tensor, perhaps with its last two dimensions swapped (HF's nn.Linear experts
[f, h] are our grouped GEMM's [h, f] columns) and with leading dimensions of one added (an
expert's matrix is one slab of our [E, h, 2f]); what no box covers is zero (the vocabulary's
padding rows).  The fused and re-ordered tensors are only that: our `qkv` per head [q k v] is
3 x heads boxes of HF's q_proj, k_proj and v_proj; `kv` per group [k v]; `weight1` of the
experts 2 x E boxes of their gate and up projections.  So any box of ours (a tensor-parallel
slice, an expert-parallel rank's experts, one expert) is read from the files with
`safe_open(...).get_slice`, touching only its bytes (`read_box`), and every HF tensor is cut
from ours by the same boxes read the other way (`hf_sources`).
"""

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Source:
    """Our box [at, at + size) is HF tensor `hf`'s box from `start` (its own dimensions: ours
    without the leading ones it lacks, the last two swapped when `transpose`).  `step`: our
    box's last dimension is every step-th of HF's from start (gpt-oss interleaves its experts'
    gate and up columns: ours are two boxes of step 2); not with `transpose`."""

    at: tuple[int, ...]
    size: tuple[int, ...]
    hf: str
    start: tuple[int, ...]
    transpose: bool = False
    step: int = 1

    def hf_size(self) -> tuple[int, ...]:
        """The extent of HF's box (a strided one's spans its last column)."""
        size = self.size[len(self.size) - len(self.start) :]
        if self.transpose:
            return (*size[:-2], size[-1], size[-2])
        return (*size[:-1], (size[-1] - 1) * self.step + 1)


@dataclass(frozen=True)
class Target:
    """One of our tensors: its global shape and the boxes of HF tensors it is made of."""

    shape: tuple[int, ...]
    sources: tuple[Source, ...]


def whole(hf: str, shape: tuple[int, ...], rows: int | None = None) -> Target:
    """Our tensor is HF's `hf` as it is (`rows`: ours has that many, the rest padding)."""
    ours = (rows, *shape[1:]) if rows is not None else shape
    return Target(ours, (Source((0,) * len(shape), shape, hf, (0,) * len(shape)),))


def interleaved(parts: list[tuple[str, int, int]], shape: tuple[int, ...]) -> Target:
    """Our tensor's rows, in order, from (HF tensor, first row, rows) runs: per head [q k v]
    or per group [k v] (`shape[1:]`: the rest of each row, 1-D biases included)."""
    sources, row = [], 0
    rest = tuple(shape[1:])
    for hf, first, rows in parts:
        zeros = (0,) * len(rest)
        sources.append(Source((row, *zeros), (rows, *rest), hf, (first, *zeros)))
        row += rows
    assert row == shape[0], (row, shape)
    return Target(shape, tuple(sources))


def attention_map(prefix: str, hf: str, c: dict, kind: str) -> dict[str, Target]:
    """Our attention `kind` ("weight" or "bias") of one layer (names under `prefix`) from HF's
    q, k, v projections under `hf`: one `qkv` per head [q k v] without grouped-query attention,
    else `q` as HF's and `kv` per group [k v]."""
    heads, groups, d, h = c["heads"], c["groups"], c["head_dim"], c["hidden"]
    rest = (h,) if kind == "weight" else ()
    q, k, v = (f"{hf}self_attn.{n}_proj.{kind}" for n in "qkv")
    if groups == heads:
        runs = [(name, j * d, d) for j in range(heads) for name in (q, k, v)]
        return {f"{prefix}attention.qkv.{kind}": interleaved(runs, (3 * heads * d, *rest))}
    runs = [(name, g * d, d) for g in range(groups) for name in (k, v)]
    return {
        f"{prefix}attention.q.{kind}": whole(q, (heads * d, *rest)),
        f"{prefix}attention.kv.{kind}": interleaved(runs, (2 * groups * d, *rest)),
    }


def experts_map(prefix: str, names: tuple[str, str, str], E: int, h: int, f: int) -> dict:
    """Our grouped GEMM's `experts.weight1` [E, h, 2f] (x @ weight1 = [gate | up]) and
    `weight2` [E, f, h] from HF's per-expert nn.Linear weights `names` = (gate, up, down) with
    "{e}" for the expert: each expert's matrix transposed into its slab."""
    gate, up, down = names
    w1, w2 = [], []
    for e in range(E):
        w1.append(Source((e, 0, 0), (1, h, f), gate.format(e=e), (0, 0), transpose=True))
        w1.append(Source((e, 0, f), (1, h, f), up.format(e=e), (0, 0), transpose=True))
        w2.append(Source((e, 0, 0), (1, f, h), down.format(e=e), (0, 0), transpose=True))
    return {
        f"{prefix}experts.weight1": Target((E, h, 2 * f), tuple(w1)),
        f"{prefix}experts.weight2": Target((E, f, h), tuple(w2)),
    }


def interleaved_experts_map(prefix: str, hf: str, E: int, h: int, f: int) -> dict:
    """gpt-oss's experts: `gate_up_proj` [E, h, 2f] and its bias [E, 2f] with gate and up
    interleaved by column (gate at even, up at odd), our `weight1` / `bias1` [gate | up] two
    boxes of step 2 each; `down_proj` [E, f, h] and its bias [E, h] our `weight2` / `bias2`."""

    def gate_up(name: str, shape: tuple) -> Target:
        lead = (0,) * (len(shape) - 1)
        half = (*shape[:-1], f)
        return Target((*shape[:-1], 2 * f), (
            Source((*lead, 0), half, name, (*lead, 0), step=2),
            Source((*lead, f), half, name, (*lead, 1), step=2),
        ))  # fmt: skip

    return {
        f"{prefix}experts.weight1": gate_up(f"{hf}gate_up_proj", (E, h, 2 * f)),
        f"{prefix}experts.bias1": gate_up(f"{hf}gate_up_proj_bias", (E, 2 * f)),
        f"{prefix}experts.weight2": whole(f"{hf}down_proj", (E, f, h)),
        f"{prefix}experts.bias2": whole(f"{hf}down_proj_bias", (E, h)),
    }


def fused_experts_map(prefix: str, hf: str, E: int, h: int, f: int) -> dict:
    """The same from transformers 5's in-memory `gate_up_proj` [E, 2f, h] (gate rows, then up)
    and `down_proj` [E, h, f], should a file hold them: each transposed per expert."""
    t1 = Source((0, 0, 0), (E, h, 2 * f), f"{hf}gate_up_proj", (0, 0, 0), transpose=True)
    t2 = Source((0, 0, 0), (E, f, h), f"{hf}down_proj", (0, 0, 0), transpose=True)
    return {
        f"{prefix}experts.weight1": Target((E, h, 2 * f), (t1,)),
        f"{prefix}experts.weight2": Target((E, f, h), (t2,)),
    }


def hf_sources(targets: dict[str, Target]) -> dict[str, list[tuple[str, Source]]]:
    """HF tensor name -> the (our tensor, box) pairs it is cut from: the map read backwards,
    in the order of our tensors."""
    out: dict[str, list] = {}
    for name, target in targets.items():
        for s in target.sources:
            out.setdefault(s.hf, []).append((name, s))
    return out


def hf_shapes_of(targets: dict[str, Target]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the map reads, at the shape its boxes span."""
    shapes: dict[str, list[int]] = {}
    for target in targets.values():
        for s in target.sources:
            end = [a + n for a, n in zip(s.start, s.hf_size(), strict=True)]
            have = shapes.setdefault(s.hf, end)
            shapes[s.hf] = [max(a, b) for a, b in zip(have, end, strict=True)]
    return {name: tuple(shape) for name, shape in shapes.items()}


def overlap(lo, size, at, extent):
    """The intersection of boxes [lo, lo + size) and [at, at + extent): (start, size), or None."""
    a = [max(x, y) for x, y in zip(lo, at, strict=True)]
    b = [min(x + n, y + m) for x, n, y, m in zip(lo, size, at, extent, strict=True)]
    if any(x >= y for x, y in zip(a, b, strict=True)):
        return None
    return a, [y - x for x, y in zip(a, b, strict=True)]


class HFFiles:
    """The safetensors of an HF directory, read a box at a time (`read`), counting the bytes
    read.  safetensors maps a file and hands out views of it: the pages a read touches stay
    in this process's resident memory until the file is closed.  So one file is open at a
    time (`keep`) and it is closed again after `remap_bytes` of reads, and what a conversion
    holds of the files is at most that much of their pages, whatever the shard or model size.
    A tensor the files store quantized (`quantized`: name -> its `hf.quantized` dequantiser,
    from `decoder.Headers`) is read from the stored blocks a box meets, dequantised; the
    bytes counted are those stored.
    """

    def __init__(
        self,
        hf_dir: Path,
        where: dict[str, str],
        keep: int = 1,
        remap_bytes=1 << 28,
        quantized: dict | None = None,
    ):
        self.hf_dir, self.where, self.keep = Path(hf_dir), where, keep
        self.quantized = quantized or {}
        self.open: OrderedDict[str, object] = OrderedDict()
        self.bytes_read = 0
        self.remap_bytes, self._since_open = remap_bytes, 0

    def _file(self, name: str):
        from safetensors import safe_open

        file = self.where[name]
        if self._since_open >= self.remap_bytes:
            self.close()
        if file in self.open:
            self.open.move_to_end(file)
            return self.open[file]
        while len(self.open) >= self.keep:
            _, last = self.open.popitem(last=False)
            last.__exit__(None, None, None)  # unmaps the file now, not when collected
        self.open[file] = safe_open(str(self.hf_dir / file), framework="pt").__enter__()
        return self.open[file]

    def read(self, name: str, start, size) -> torch.Tensor:
        """HF tensor `name`'s box [start, start + size), a tensor of its own."""
        if name in self.quantized:
            return self.quantized[name].read(self.read_stored, start, size)
        return self.read_stored(name, start, size)

    def read_stored(self, name: str, start, size) -> torch.Tensor:
        """The box of the tensor `name` as the files store it."""
        index = tuple(slice(a, a + n) for a, n in zip(start, size, strict=True))
        try:
            t = self._file(name).get_slice(name)[index]
        except Exception as e:  # safetensors raises its own errors for a truncated file
            from megatrain.hf.common import HFFormatError

            path = self.hf_dir / self.where[name]
            raise HFFormatError(f"{path}: cannot read {name} ({e}); is the file complete?") from e
        self.bytes_read += t.numel() * t.element_size()
        self._since_open += t.numel() * t.element_size()
        return t

    def close(self):
        self._since_open = 0
        while self.open:
            self.open.popitem()[1].__exit__(None, None, None)


def streamed(
    targets: dict[str, Target],
    files: HFFiles,
    dtypes: dict[str, torch.dtype],
    dtype: torch.dtype | None = None,
) -> dict:
    """Our tensors as `checkpoint.convert.Streamed` ones, each piece read from `files` only
    when the checkpoint writer reaches it: a stacked expert tensor (3-D) an expert at a time,
    any other whole.  Each in `dtype`, else its HF tensor's (`dtypes`: HF name -> dtype); an
    expert bias (`checkpoint.dcp.STATE_BUFFERS`) in fp32 always."""
    from megatrain.checkpoint.convert import Streamed
    from megatrain.checkpoint.dcp import STATE_BUFFERS

    def piece(target: Target, lo: tuple, size: tuple, kind: torch.dtype):
        def make() -> torch.Tensor:
            out = torch.empty(size, dtype=kind)
            read_box(target, files, lo, size, out)
            return out

        return (lo, size, make)

    out = {}
    for name, t in targets.items():
        kind = dtype or dtypes[t.sources[0].hf]
        if name.endswith(STATE_BUFFERS):  # expert biases stay fp32, as a run keeps them
            kind = torch.float32
        if len(t.shape) == 3:
            chunks = [piece(t, (e, 0, 0), (1, *t.shape[1:]), kind) for e in range(t.shape[0])]
        else:
            chunks = [piece(t, (0,) * len(t.shape), t.shape, kind)]
        out[name] = Streamed(t.shape, kind, chunks)
    return out


def read_box(target: Target, files: HFFiles, lo, size, out: torch.Tensor) -> None:
    """Fill `out` (shaped `size`) with our tensor's box [lo, lo + size) from the files: each
    source it meets read as a slice of its HF tensor, the rest (padding) zero."""
    out.zero_()
    for s in target.sources:
        meet = overlap(lo, size, s.at, s.size)
        if meet is None:
            continue
        start, extent = meet
        n = len(s.start)
        rel = [a - b for a, b in zip(start, s.at, strict=True)][len(start) - n :]
        box = extent[len(extent) - n :]
        if s.transpose:
            rel[-2:], box[-2:] = rel[-2:][::-1], box[-2:][::-1]
        if s.step > 1:  # the span of the strided columns, read once, then every step-th
            rel[-1], box[-1] = rel[-1] * s.step, (box[-1] - 1) * s.step + 1
        piece = files.read(s.hf, [a + r for a, r in zip(s.start, rel, strict=True)], box)
        if s.transpose:
            piece = piece.transpose(-1, -2)
        if s.step > 1:
            piece = piece[..., :: s.step]
        view = out[
            tuple(slice(a - b, a - b + m) for a, b, m in zip(start, lo, extent, strict=True))
        ]
        view.copy_(piece.reshape(extent))


__all__ = [
    "HFFiles",
    "Source",
    "Target",
    "attention_map",
    "experts_map",
    "fused_experts_map",
    "hf_shapes_of",
    "hf_sources",
    "interleaved",
    "interleaved_experts_map",
    "overlap",
    "read_box",
    "streamed",
    "whole",
]
