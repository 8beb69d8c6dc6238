"""Quantized Hugging Face checkpoints read as they are published, each tensor dequantised as it
is read: DeepSeek's block-scaled FP8 (DeepSeek-V3/R1, Kimi K2: `quantization_config.quant_method`
"fp8") and OpenAI's MXFP4 (gpt-oss: "mxfp4").  The format, not the architecture: a family the
importers read (a Llama, a Mixtral, ...) stored so is read; DeepSeek-V3's and gpt-oss's own
model_types are refused by the importers until their architectures are read.

What the files hold, and what a reader sees instead (`logical_headers`, called by
`decoder.read_headers`, so every importer and `run --load-hf` read through it):

- **FP8**: a Linear weight `<name>` [..., rows, cols] stored as float8_e4m3fn with a float32
  `<name>_scale_inv` [..., ceil(rows / b0), ceil(cols / b1)], one per block of
  `weight_block_size` [b0, b1]; the edge blocks may be partial (DeepSeek-V3's 576-row
  kv_a_proj_with_mqa holds 4.5 blocks of 128 rows).  The weight is fp8.float() * scale_inv of
  its block, the product in float32 (transformers' `_dequantize_fp8_weight` at float32, and
  its loader's `Fp8Dequantize`, which refuses partial blocks), rounded once to the
  dequantised dtype.  The reader sees `<name>` at its own shape; the scale is gone.
- **MXFP4**: an expert tensor `<name>` stored as `<name>_blocks` (uint8 [E, R, G, 16]: 32 e2m1
  values a block, two a byte, the low nibble first) and `<name>_scales` (uint8 [E, R, G]:
  each block's power of two, biased by 127).  Dequantised as transformers'
  `convert_moe_packed_tensors`: the values of a row of R laid out along G x 32, then the last
  two dimensions swapped, so the reader sees `<name>` [E, G x 32, R], the layout HF's
  GptOssExperts holds (`gate_up_proj` [E, h, 2f] from blocks [E, 2f, h / 32, 16], `down_proj`
  [E, f, h] from [E, h, f / 32, 16]).

The dequantised dtype is config.json's `dtype` (`torch_dtype` in transformers 4's files),
else bfloat16, what both publishers' models compute in.  A module that
`quantization_config.modules_to_not_convert` names (matched as transformers'
`should_convert_module` does) keeps its tensors as stored, under their stored names; a reader
then refuses them as it refuses any tensor it does not expect.

A box of a dequantised tensor (`HFFiles.read`: a tensor-parallel slice, one expert, an
expert-parallel rank's experts) reads only the stored blocks it meets, whatever the box: an
FP8 weight the box's elements and the scales of the blocks they fall in, an MXFP4 tensor the
box's experts and rows and the 32-value blocks its columns fall in (never the whole stored
tensor).  Beyond the box it returns a read holds the temporaries of one piece at a time: an
FP8 box a band of block rows (about `CHUNK` float32 values), an MXFP4 box an expert (a few
float32 copies of one expert's box), so memory stays per tensor, never the whole model.

Refused before any tensor is read, naming config.json's field or the file and tensor: a
quant_method other than these, an FP8 `fmt` other than e4m3, static activation scales, a
`weight_block_size` that is not two positive integers; an FP8 weight without its scale, or
whose scale grid does not cover it (not ceil(rows / b0) x ceil(cols / b1)); an MXFP4 tensor
without its scales, or whose blocks and scales disagree in shape.
"""

import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain.hf.common import HFFormatError

QUANT_METHODS = ("fp8", "mxfp4")
# config.json's dtype names -> safetensors' (the dtypes a dequantised tensor can take).
DTYPE_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
FLOAT_SCALES = ("F32", "BF16", "F16")
FP8_BLOCK_DEFAULT = (128, 128)  # transformers' FineGrainedFP8Config default
MX_BLOCK = 32  # values per MXFP4 block
# e2m1 by its 4 bits (transformers' FP4_VALUES): the sign bit, then 2 exponent bits, 1 mantissa.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
CHUNK = 1 << 24  # float32 values a read computes at once (64 MB)


@dataclass(frozen=True)
class Quantization:
    """config.json's `quantization_config`, as read: the method, FP8's block [b0, b1], the
    modules kept as stored, and the dtype the tensors dequantise to."""

    method: str
    block: tuple[int, int] | None
    not_convert: tuple[str, ...]
    dtype: str
    config_file: Path


def read_quantization(config_file: Path, c: dict) -> Quantization | None:
    """config.json `c`'s quantization_config (None when it has none), refused by field."""
    q = c.get("quantization_config")
    if q is None:
        return None

    def refuse(field: str, why: str):
        raise HFFormatError(
            f"{config_file}: quantization_config.{field} is {q.get(field)!r}: {why}"
        )

    if not isinstance(q, dict):
        raise HFFormatError(f"{config_file}: quantization_config is {q!r}; expected an object")
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        refuse("quant_method", f"read are {', '.join(QUANT_METHODS)} (DeepSeek's, OpenAI's)")
    skip = q.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(p, str) for p in skip):
        refuse("modules_to_not_convert", "expected a list of module names")
    block = None
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            refuse("fmt", "only e4m3 FP8 weights are read")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            refuse("activation_scheme", "static activation scales are not read; expected dynamic")
        block = q.get("weight_block_size", list(FP8_BLOCK_DEFAULT))
        if not (
            isinstance(block, list | tuple)
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            refuse("weight_block_size", "expected two positive integers [rows, cols]")
        block = (block[0], block[1])
    dtype_field = "dtype" if "dtype" in c else "torch_dtype"
    dtype = c.get(dtype_field) or "bfloat16"
    if dtype not in DTYPE_NAMES:
        raise HFFormatError(
            f"{config_file}: {dtype_field} is {dtype!r}: a quantized model dequantises to one "
            f"of {', '.join(DTYPE_NAMES)}"
        )
    return Quantization(method, block, tuple(skip), dtype, config_file)


def should_convert(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether `module` is quantized, as transformers' `should_convert_module` decides: not
    when a pattern matches it from the start up to a module boundary (as a regex: "layer.*"
    matches "layer.11.attn", "mlp.gate" not "mlp.gate_proj") or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in patterns)


@dataclass(frozen=True)
class FP8Weight:
    """An FP8 weight and its block scales, read a box at a time (`read`)."""

    weight: str
    scale: str
    shape: tuple[int, ...]
    block: tuple[int, int]
    dtype: torch.dtype
    nbytes: int  # the stored bytes: the weight's and its scales'

    def read(self, read_stored, start, size) -> torch.Tensor:
        """The box [start, start + size) dequantised, from the stored elements it holds and
        the scales of their blocks (`read_stored(name, start, size)`: a stored box).  Each
        band of block rows goes into a float32 buffer of whole blocks, which is scaled in
        place block by block: the same float32 product for every element as a scale
        expanded to the weight's shape, without the expanded copy."""
        out = torch.empty(tuple(size), dtype=self.dtype)
        *lead0, r0, c0 = start
        *leads, nr, nc = size
        b0, b1 = self.block
        s1 = c0 // b1
        sc = -(-(c0 + nc) // b1) - s1  # the blocks the columns meet
        band = max(b0, CHUNK // (sc * b1) // b0 * b0)  # whole block rows a pass
        slabs = itertools.product(*(range(a, a + n) for a, n in zip(lead0, leads, strict=True)))
        for lead in slabs:
            at = tuple(i - a for i, a in zip(lead, lead0, strict=True))
            one = (1,) * len(lead)
            r = r0
            while r < r0 + nr:
                n = min(r0 + nr, (r // b0) * b0 + band) - r
                s0 = r // b0
                sr = -(-(r + n) // b0) - s0
                scale = read_stored(self.scale, (*lead, s0, s1), (*one, sr, sc))
                blocks = torch.empty(sr, b0, sc, b1)  # its rows and columns past the box unread
                inside = blocks.view(sr * b0, sc * b1)[
                    r - s0 * b0 : r - s0 * b0 + n, c0 - s1 * b1 : c0 - s1 * b1 + nc
                ]
                inside.copy_(read_stored(self.weight, (*lead, r, c0), (*one, n, nc)).reshape(n, nc))
                blocks.mul_(scale.reshape(sr, 1, sc, 1).float())
                out[(*at, slice(r - r0, r - r0 + n))] = inside
                r += n
        return out


@dataclass(frozen=True)
class MXFP4Tensor:
    """An MXFP4 tensor (its blocks and scales) at its dequantised shape [E, G x 32, R], read a
    box at a time (`read`)."""

    blocks: str
    scales: str
    shape: tuple[int, int, int]
    dtype: torch.dtype
    nbytes: int

    def read(self, read_stored, start, size) -> torch.Tensor:
        """The box [start, start + size) dequantised, an expert at a time, from its experts'
        rows' blocks that hold its columns."""
        (e0, h0, r0), (ne, nh, nr) = start, size
        g0 = h0 // MX_BLOCK
        ng = -(-(h0 + nh) // MX_BLOCK) - g0
        # A byte's two values, the low nibble first: one gather a byte.
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
        pairs = torch.stack((lut.repeat(16), lut.repeat_interleave(16)), dim=-1)  # [256, 2]
        out = torch.empty((ne, nh, nr), dtype=self.dtype)
        lo = h0 - g0 * MX_BLOCK
        for i in range(ne):
            blocks = read_stored(self.blocks, (e0 + i, r0, g0, 0), (1, nr, ng, 16))[0]
            scales = read_stored(self.scales, (e0 + i, r0, g0), (1, nr, ng))[0]
            values = pairs.index_select(0, blocks.reshape(-1).to(torch.int32)).view(nr, ng, -1)
            exponents = scales.to(torch.int32)[..., None] - 127
            if exponents.max() < 128:  # x * 2.0 ** e, exact: one power of two a block
                values.mul_(torch.ldexp(torch.ones(exponents.shape), exponents))
            else:  # a byte of 255: 2 ** 128 is past float32's range, ldexp(0.5, 128) is not
                values = torch.ldexp(values, exponents)
            out[i] = values.view(nr, ng * MX_BLOCK)[:, lo : lo + nh].T
        return out


def _fp8_weights(q, hf_dir, shapes, dtypes, where) -> dict[str, FP8Weight]:
    out = {}
    for name, shape in shapes.items():
        if dtypes[name] != "F8_E4M3" or not should_convert(name.rpartition(".")[0], q.not_convert):
            continue
        scale, path = f"{name}_scale_inv", hf_dir / where[name]
        if scale not in shapes:
            raise HFFormatError(
                f"{path}: {name} is FP8 (F8_E4M3) without its scale {scale}; "
                f"{q.config_file.name} says quant_method fp8"
            )
        b0, b1 = q.block
        grid = (*shape[:-2], -(-shape[-2] // b0), -(-shape[-1] // b1)) if len(shape) >= 2 else None
        if shapes[scale] != grid:
            raise HFFormatError(
                f"{hf_dir / where[scale]}: {scale} has shape {shapes[scale]}; {name} "
                f"{shape} in blocks of weight_block_size {list(q.block)} needs {grid}"
            )
        if dtypes[scale] not in FLOAT_SCALES:
            raise HFFormatError(
                f"{hf_dir / where[scale]}: {scale} is {dtypes[scale]}; expected one of "
                f"{', '.join(FLOAT_SCALES)}"
            )
        nbytes = math.prod(shape) + math.prod(grid) * (4 if dtypes[scale] == "F32" else 2)
        out[name] = FP8Weight(name, scale, shape, q.block, getattr(torch, q.dtype), nbytes)
    return out


def _mxfp4_tensors(q, hf_dir, shapes, dtypes, where) -> dict[str, MXFP4Tensor]:
    out = {}
    for name, shape in shapes.items():
        base = name.removesuffix("_blocks")
        if base == name or not should_convert(base.rpartition(".")[0], q.not_convert):
            continue
        scales, path = f"{base}_scales", hf_dir / where[name]
        if dtypes[name] != "U8" or len(shape) != 4 or shape[-1] != 16:
            raise HFFormatError(
                f"{path}: {name} is {dtypes[name]} {shape}; MXFP4 blocks are U8 [experts, rows, "
                "blocks, 16]"
            )
        if scales not in shapes:
            raise HFFormatError(
                f"{path}: {name} is MXFP4 without its scales {scales}; "
                f"{q.config_file.name} says quant_method mxfp4"
            )
        if shapes[scales] != shape[:-1] or dtypes[scales] != "U8":
            raise HFFormatError(
                f"{hf_dir / where[scales]}: {scales} is {dtypes[scales]} {shapes[scales]}; "
                f"the blocks {name} {shape} need U8 {shape[:-1]}"
            )
        E, R, G, _ = shape
        nbytes = math.prod(shape) + math.prod(shape[:-1])
        logical = (E, G * MX_BLOCK, R)
        out[base] = MXFP4Tensor(name, scales, logical, getattr(torch, q.dtype), nbytes)
    return out


def logical_headers(hf_dir: Path, q: Quantization | None, shapes: dict, dtypes: dict,
                    where: dict) -> tuple[dict, dict, dict, dict]:  # fmt: skip
    """(shapes, dtypes, where, dequantisers) of the tensors a reader sees, from the stored
    ones' (name -> shape, safetensors dtype, file): each quantized tensor under its own name,
    at its dequantised shape and dtype, its blocks and scales gone from shapes and dtypes
    (`where` keeps them: the reads find their files).  Unquantized files pass as they are."""
    if q is None:
        return shapes, dtypes, where, {}
    find = _fp8_weights if q.method == "fp8" else _mxfp4_tensors
    quantized = find(q, hf_dir, shapes, dtypes, where)
    # stored name -> the dequantised tensor it becomes (None: a scale, read with its tensor)
    becomes = {}
    for name, t in quantized.items():
        first, second = (t.weight, t.scale) if isinstance(t, FP8Weight) else (t.blocks, t.scales)
        becomes[first], becomes[second] = name, None
    out_shapes, out_dtypes, out_where = {}, {}, dict(where)
    for stored, shape in shapes.items():  # in the files' order
        name = becomes.get(stored, stored)
        if name is None:
            continue
        if name in quantized:
            out_shapes[name], out_dtypes[name] = quantized[name].shape, DTYPE_NAMES[q.dtype]
            out_where[name] = where[stored]
        else:
            out_shapes[name], out_dtypes[name] = shape, dtypes[stored]
    return out_shapes, out_dtypes, out_where, quantized


__all__ = [
    "FP8Weight",
    "MXFP4Tensor",
    "Quantization",
    "logical_headers",
    "read_quantization",
    "should_convert",
]
