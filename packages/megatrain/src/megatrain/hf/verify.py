"""The parity report of `megatrain import-hf --verify` and `export-hf --verify`: transformers'
model of a Hugging Face directory and ours of a checkpoint run on the same few hundred tokens
of text (eager attention and experts, fp32 unless asked otherwise), compared by max |Δ logit|
over the real vocabulary (not our padding), the KL divergence KL(HF || ours) of the
next-token distributions (mean and max over positions), top-1 agreement and, to locate a
mismatch, each decoder layer's output hidden states (max |Δ|, and the first layer where it
passes `LAYER_RTOL` of HF's largest activation).

The two models never share memory: HF's runs first (its logits and layer outputs kept), then
ours, each whole where the estimate (`memory_plan`) fits the host-memory budget, else layer
by layer (`hf/layerwise.py`: one module's weights held at a time).  The decoder families:
GPT-2, Llama, Mistral, Qwen2/3, Mixtral, Qwen2/3-MoE; BERT is not covered.
"""

import contextlib
import gc
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from megatrain.hf.layerwise import VerifyError, run_hf, run_ours

# Default max |Δ logit| past which a check fails, by the dtype both models run in.  fp32
# differs by summation order only: 1e-6 to 4e-5 measured on tiny random models (~1e-4
# expected at 7B); a misplaced or wrong weight moves logits by O(1).  bf16 and fp16 round
# each model's activations at its own places (and can flip an expert's routing): measured
# 0.02 (bf16) and 0.003 (fp16) at a trained model's scale, up to 2.5 and 0.5 on tiny
# models with activations ~100 (docs/checkpoints.md).
TOLERANCES = {"float32": 1e-2, "bfloat16": 2.0, "float16": 0.5}
# A layer "differs" when its max |Δ hidden| exceeds this fraction of HF's largest activation.
LAYER_RTOL = {"float32": 1e-4, "bfloat16": 0.1, "float16": 0.02}
DEFAULT_TOKENS = 256
DEFAULT_TEXT = (
    "The history of the lighthouse is, in a sense, the history of the coast itself. Long "
    "before engineers learned to cast iron towers or grind glass lenses, fishermen lit fires "
    "on headlands so that their families could find the harbour after dark. The Romans built "
    "a great tower at Alexandria's rival ports, and its light, fed with wood and later with "
    "oil, was said to be visible for many miles. For centuries afterwards most lights were "
    "little more than open braziers, smoky and unreliable, and a keeper who fell asleep could "
    "cost a ship its crew. Everything changed in the early nineteenth century, when a French "
    "physicist named Augustin Fresnel designed a lens made of concentric rings of prisms. "
    "Instead of a single thick piece of glass, which would have been impossibly heavy, his "
    "lens bent the light of one small lamp into a narrow, powerful beam. Within a few decades "
    "Fresnel lenses were installed along the coasts of Europe and America, and sailors began "
    "to recognise each station by the pattern of its flashes: two short and one long, or a "
    "steady glow interrupted every ten seconds. Keepers and their families lived in small "
    "houses beside the towers, trimming wicks, polishing brass and recording the weather in "
    "careful logbooks. Storms sometimes cut them off from the mainland for weeks. Today most "
    "lighthouses are automatic, watched by sensors and satellites rather than by people, and "
    "many of the old keepers' cottages have become museums. Yet the towers still matter: on a "
    "dark night, with the instruments failing and the rain coming sideways, a familiar light "
    "on the horizon remains the simplest way of knowing exactly where you are."
)


def available_memory() -> int:
    """Bytes of host memory available now (MemAvailable, else the free physical pages)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _token_ids(hf_dir: Path, directory: Path, text: str, n: int) -> list[int]:
    """The first `n` tokens of `text` by the HF directory's tokenizer.json (the checkpoint's,
    which an import copies or builds from HF's files, when the directory has none)."""
    from tokenizers import Tokenizer

    path = hf_dir / "tokenizer.json"
    path = path if path.is_file() else directory / "tokenizer.json"
    ids = Tokenizer.from_file(str(path)).encode(text).ids[:n]
    if len(ids) < 2:
        raise VerifyError(f"the text is {len(ids)} token(s) by {path}: give a longer one")
    return ids


def memory_plan(directory: Path, meta: dict, dtype: torch.dtype, n: int) -> dict:
    """Bytes a check of `n` tokens needs (an estimate): whole (the larger model, one at a
    time, with loading's slack) and layer by layer (its largest module, thrice: HF's read,
    its cast, ours), each plus the activations (logits, layer outputs, attention scores)."""
    import torch.distributed.checkpoint as dcp

    size = torch.empty((), dtype=dtype).element_size()
    saved = dcp.FileSystemReader(str(directory / "model")).read_metadata().state_dict_metadata
    groups: dict[str, int] = {}
    for name, item in saved.items():
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "layers" else name
        groups[key] = groups.get(key, 0) + math.prod(item.size) * size
    m = meta["model"]
    h, ffn = m["hidden_size"], m.get("ffn_hidden_size") or 4 * m["hidden_size"]
    activations = 4 * n * (
        6 * meta.get("padded_vocab_size", meta["vocab_size"]) + 3 * (m["num_layers"] + 2) * h
        + 4 * n * m["num_attention_heads"] + 4 * ffn
    )  # fmt: skip
    return {
        "whole_model_bytes": int(1.25 * sum(groups.values())) + activations,
        "layer_by_layer_bytes": 3 * max(groups.values()) + activations,
    }


def _number(x: float):
    return x if math.isfinite(x) else str(x)  # JSON has no NaN


def _g(x) -> str:
    return f"{x:.3g}" if isinstance(x, float | int) else str(x)


def _compare(hf_logits, our_logits, hf_layers, our_layers, tol: float, rtol: float) -> dict:
    if len(hf_layers) != len(our_layers):
        raise VerifyError(f"HF ran {len(hf_layers)} layers, ours {len(our_layers)}")
    diff = (our_logits - hf_logits).abs().max().item()
    p, q = (torch.log_softmax(x.double(), -1) for x in (hf_logits, our_logits))
    kl = (p.exp() * (p - q)).sum(-1).clamp_min(0)  # per position
    agree = (hf_logits.argmax(-1) == our_logits.argmax(-1)).double().mean().item()
    deltas = [(a - b).abs().max().item() for a, b in zip(hf_layers, our_layers, strict=True)]
    scales = [a.abs().max().item() for a in hf_layers]
    relative = [d / max(s, 1e-30) if math.isfinite(d) else math.inf
                for d, s in zip(deltas, scales, strict=True)]  # fmt: skip
    off = [i for i, r in enumerate(relative) if not r <= rtol]
    return {
        "passed": diff <= tol,  # False for NaN
        "tolerance": tol,
        "max_abs_logit_diff": _number(diff),
        "mean_abs_logit": _number(hf_logits.abs().mean().item()),
        "kl_mean": _number(kl.mean().item()),
        "kl_max": _number(kl.max().item()),
        "top1_agreement": agree,
        "layer_max_abs_diff": [_number(d) for d in deltas],
        "layer_max_abs": [_number(s) for s in scales],
        "layer_rtol": rtol,
        "worst_layer": max(range(len(relative)), key=relative.__getitem__) if relative else None,
        "first_layer_off": off[0] if off else None,
    }


def verify(
    hf_dir: str | Path,
    ckpt: str | Path,
    text: str | None = None,
    tokens: int = DEFAULT_TOKENS,
    tol: float | None = None,
    dtype: str = "float32",
    memory_budget: int | None = None,
    layer_by_layer: bool | None = None,
    text_name: str | None = None,
    rounded: str | None = None,
) -> dict:
    """The parity report of the HF directory `hf_dir` against the checkpoint `ckpt` (its
    `latest`): `tokens` tokens of `text` (None: `DEFAULT_TEXT`) through both models in
    `dtype`, both models' weights first rounded to `rounded` (the dtype a conversion cast
    them to, so that both hold the same numbers; None: as stored);
    `passed` when max |Δ logit| <= `tol` (None: `TOLERANCES[dtype]`).  Layer by layer when the
    whole model's estimate exceeds `memory_budget` bytes (None: 90% of `available_memory`),
    or as `layer_by_layer` says.  Runs in this process's group, or in a one-rank gloo group of
    its own."""
    args = dict(locals())
    if dist.is_initialized():
        return _verify(**args)
    from megatrain.run.launch import run_workers

    return run_workers(_verify_worker, (args,), 1)[0]


def _verify_worker(args: dict) -> dict:
    from megacore import parallel_state as ps

    dist.init_process_group("gloo")  # run_workers' environment: a world of one
    ps.initialize_model_parallel(1, 1)
    return _verify(**args)


def _verify(hf_dir, ckpt, text, tokens, tol, dtype, memory_budget, layer_by_layer, text_name,
            rounded) -> dict:  # fmt: skip
    import transformers

    from megatrain.checkpoint.convert import dtype_of
    from megatrain.checkpoint.files import find_checkpoint, read_meta
    from megatrain.inference.load import model_kind

    torch_dtype, hf_dir = dtype_of(dtype), Path(hf_dir).resolve()
    tol = TOLERANCES[dtype] if tol is None else tol
    directory = find_checkpoint(ckpt).resolve()
    meta = read_meta(directory)
    if model_kind(meta) == "bert":
        raise VerifyError(f"{directory}: a BERT; --verify covers the decoder families only")
    n = min(tokens, meta["model"]["max_position_embeddings"])
    ids = torch.tensor([_token_ids(hf_dir, directory, text or DEFAULT_TEXT, n)])
    plan = memory_plan(directory, meta, torch_dtype, ids.shape[1])
    budget = int(0.9 * available_memory()) if memory_budget is None else memory_budget
    streamed = plan["whole_model_bytes"] > budget if layer_by_layer is None else layer_by_layer
    vocab = meta["vocab_size"]
    round_to = None if rounded in (None, dtype) else dtype_of(rounded)
    hf_logits, hf_layers = run_hf(hf_dir, ids, torch_dtype, streamed, round_to)
    gc.collect()  # HF's model is gone before ours is read
    if hf_logits.shape[-1] != vocab:
        raise VerifyError(f"{hf_dir}: a vocabulary of {hf_logits.shape[-1]}, {directory} {vocab}")
    our_logits, our_layers = run_ours(ckpt, directory, meta, ids, torch_dtype, streamed, round_to)
    report = _compare(
        hf_logits, our_logits[..., :vocab], hf_layers, our_layers, tol, LAYER_RTOL[dtype]
    )
    return {
        **report,
        "dtype": dtype,
        "weights_rounded_to": rounded if round_to is not None else None,
        "tokens": ids.shape[1],
        "text": text_name or ("built-in" if text is None else "given"),
        "mode": "layer by layer" if streamed else "whole model",
        "memory": {"budget_bytes": budget, **plan},
        "hf_dir": str(hf_dir),
        "checkpoint": str(directory),
        "transformers": transformers.__version__,
    }


def format_report(r: dict) -> str:
    """The report as a few lines, one per metric, the worst layer and the verdict."""
    worst, off = r["worst_layer"], r["first_layer_off"]

    def layer(i):
        return f"{i}: max |Δ hidden| {_g(r['layer_max_abs_diff'][i])} (HF's max |h| " \
               f"{_g(r['layer_max_abs'][i])})"  # fmt: skip

    verdict = (
        "PASSED" if r["passed"] else
        f"FAILED: max |Δ logit| {_g(r['max_abs_logit_diff'])} > tolerance {r['tolerance']:g}"
    )  # fmt: skip
    return "\n".join([
        f"parity of {r['hf_dir']} and {r['checkpoint']}: {r['tokens']} tokens ({r['text']} "
        f"text), {r['dtype']}, {r['mode']}",
        f"  max |Δ logit|    {_g(r['max_abs_logit_diff'])}  (tolerance {r['tolerance']:g}; "
        f"mean |logit| {_g(r['mean_abs_logit'])})",
        f"  KL(HF || ours)   mean {_g(r['kl_mean'])}, max {_g(r['kl_max'])}",
        f"  top-1 agreement  {r['top1_agreement']:.4f}",
        f"  worst layer      {layer(worst) if worst is not None else '-'}",
        f"  first layer off  {layer(off) if off is not None else 'none'} "
        f"(past {r['layer_rtol']:g} of HF's max |h|)",
        f"  {verdict}",
    ])  # fmt: skip


def record_report(ckpt: str | Path, report: dict) -> None:
    """The report into the checkpoint's meta.json as `imported_from["verify"]` (meta.json is
    not in its own file list: the checkpoint stays whole)."""
    from megacommon.files import atomic_write_json
    from megatrain.checkpoint.files import find_checkpoint, read_meta

    directory = find_checkpoint(ckpt)
    meta = read_meta(directory)
    meta["imported_from"] = {**(meta.get("imported_from") or {}), "verify": report}
    atomic_write_json(directory / "meta.json", meta, sort_keys=False)


def cli_check(hf_dir, ckpt, options: dict, record: bool = False) -> dict:
    """`--verify` of import-hf and export-hf: the report printed (and, `record`, written into
    the checkpoint's meta.json); a failed check exits 1 naming the first layer off."""
    import click

    from megacommon.errors import FAILURE, CommandError

    text_file, memory = options["verify_text"], options["verify_memory"]
    try:
        report = verify(
            hf_dir, ckpt, text=Path(text_file).read_text() if text_file else None,
            tol=options["verify_tol"], dtype=options["verify_dtype"] or "float32",
            memory_budget=None if memory is None else int(memory * 2**30), text_name=text_file,
            rounded=options.get("rounded"),
        )  # fmt: skip
        if record:
            record_report(ckpt, report)
    except (ValueError, ImportError, OSError) as e:
        raise CommandError(f"--verify: {e}", FAILURE) from None
    click.echo(format_report(report))
    if not report["passed"]:
        off = report["first_layer_off"]
        raise CommandError(
            f"--verify failed: max |Δ logit| {_g(report['max_abs_logit_diff'])} > "
            f"{report['tolerance']:g}" + (f", first layer off: {off}" if off is not None else "")
            + (" (the report is in meta.json's imported_from.verify)" if record else ""),
            FAILURE,
        )  # fmt: skip
    return report
