"""HF's model and ours run on the same tokens for the parity report (`hf/verify.py`), each
whole (`from_pretrained`, `inference.load.load_model`) or layer by layer: built with its
parameters on the meta device, every module that holds weights (a decoder layer, the
embeddings, the final norm, the output layer) gets its tensors just before it runs (HF's
read with `safe_open`, ours from the checkpoint's DCP files, only that module's) and gives
them back after, so the peak is one layer, not the model.  Both paths run the same forward,
so their numbers are the same.  Each run returns its logits in fp32 and every decoder layer's
output hidden states [b, s, h].
"""

import contextlib
import warnings
from pathlib import Path

import torch
from torch import nn


class VerifyError(ValueError):
    """A parity check that cannot run (a model kind it does not cover, files it cannot read)."""


@contextlib.contextmanager
def _params_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no init) and
    keep their buffers real (rotary frequencies, counters), as accelerate's
    `init_empty_weights` does."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@contextlib.contextmanager
def _streamed(model: nn.Module, layers: list[str], read):
    """Layer by layer: each decoder layer of `model`, and every other module holding
    parameters of its own (embeddings, norms, output layer), gets its tensors (`read(name,
    module)`: parameter name -> tensor) just before it runs and gives them back after."""
    groups = {name: model.get_submodule(name) for name in layers}
    for name, m in model.named_modules():
        inside = any(name == n or name.startswith(n + ".") for n in layers)
        if not inside and next(m.parameters(recurse=False), None) is not None:
            groups[name] = m

    def load(module, args, name):
        for key, t in read(name, module).items():
            owner, _, leaf = key.rpartition(".")
            sub = module.get_submodule(owner)
            if leaf in sub._parameters:
                # requires_grad as built, even without grad mode: torch's matmul takes another
                # path (another rounding) for a 3-D input's GEMM when the weight requires grad.
                grad = sub._parameters[leaf].requires_grad
                sub._parameters[leaf] = nn.Parameter(t, requires_grad=grad)
            else:
                sub._buffers[leaf] = t

    def free(module, args, out):
        for sub in module.modules():
            for leaf, p in sub._parameters.items():
                if p is not None and not p.is_meta:
                    sub._parameters[leaf] = nn.Parameter(
                        p.to("meta"), requires_grad=p.requires_grad
                    )

    handles = []
    for name, module in groups.items():
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: load(m, a, n)))
        handles.append(module.register_forward_hook(free))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _forward(model: nn.Module, layers: list[str], seq_first: bool, stream, call):
    """`call()`'s logits in fp32 and the output hidden states [b, s, h] of each of `layers`,
    with the context `stream` around it."""
    captured = []

    def keep(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        captured.append((h.transpose(0, 1) if seq_first else h).detach().float())

    handles = [model.get_submodule(n).register_forward_hook(keep) for n in layers]
    try:
        with stream, torch.no_grad():
            logits = call()
    finally:
        for h in handles:
            h.remove()
    return logits.float(), captured


def _params_to(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` with its parameters in `dtype` (its buffers, the rotary frequencies and expert
    biases kept in fp32, as they are)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def _safetensors(hf_dir: Path):
    """(names, get): the tensors of an HF directory's safetensors files, read one by one."""
    from safetensors import safe_open

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        from megatrain.hf.common import read_json

        shards = read_json(index)["weight_map"]
    elif (hf_dir / "model.safetensors").is_file():
        with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
            shards = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        raise VerifyError(
            f"{hf_dir}: layer by layer reads model.safetensors (or its index) only; give "
            "a larger --verify-memory to load pytorch_model.bin whole"
        )
    opened = {}

    def get(name: str) -> torch.Tensor:
        shard = shards[name]
        if shard not in opened:
            opened[shard] = safe_open(str(hf_dir / shard), "pt")
        return opened[shard].get_tensor(name)

    return shards, get


def _hf_reader(model: nn.Module, hf_dir: Path, rounded: torch.dtype | None):
    """`read` for `_streamed` over HF's model: each parameter from the file's tensor of its
    name (with or without the base model's prefix; Mixtral's `block_sparse_moe` for `mlp`),
    transformers 5's 3-D experts stacked from the per-expert matrices the files hold, a tied
    output layer from the input embeddings; rounded to `rounded` (None: as the files hold).
    A buffer the files hold (DeepSeek-V3's `e_score_correction_bias`) in its own dtype."""
    names, get = _safetensors(hf_dir)
    prefix, tied = model.base_model_prefix, {}
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is not None and getattr(model.config, "tie_word_embeddings", False):
        where = {m: n for n, m in model.named_modules()}
        tied[f"{where[out]}.weight"] = f"{where[inp]}.weight"

    def first(keys: list[str]) -> torch.Tensor | None:
        for key in keys:
            for k in (key, key.replace(".mlp.", ".block_sparse_moe.")):
                for name in (k, k.removeprefix(prefix + "."), f"{prefix}.{k}"):
                    if name in names:
                        return get(name)
        return None

    def tensor(key: str, like: torch.Tensor) -> torch.Tensor:
        found = first([key])
        base, _, leaf = key.rpartition(".")
        # [E, 2f, h] ([gate; up] per expert) and [E, h, f]: Qwen's names, or Mixtral's.
        parts = {"gate_up_proj": (("gate_proj", "w1"), ("up_proj", "w3")),
                 "down_proj": (("down_proj", "w2"),)}.get(leaf)  # fmt: skip
        if found is None and parts and base.endswith("experts"):
            pieces = [[first([f"{base}.{e}.{n}.weight" for n in alias]) for alias in parts]
                      for e in range(like.shape[0])]  # fmt: skip
            if all(p is not None for row in pieces for p in row):
                found = torch.stack([torch.cat(row) for row in pieces])
        if found is None and key in tied:
            found = tensor(tied[key], like)
        if found is None:
            raise VerifyError(f"{hf_dir}: no tensor for {key} of {type(model).__name__}")
        return (found if rounded is None else found.to(rounded)).to(like.dtype)

    def read(name: str, module: nn.Module) -> dict:
        full = f"{name}." if name else ""
        out = {n: tensor(full + n, p) for n, p in module.named_parameters(remove_duplicate=False)}
        for n, b in module.named_buffers():  # the files' (DeepSeek-V3's correction bias), as held
            found = first([full + n])
            if found is not None:
                out[n] = found.to(b.dtype)
        return out

    return read


def _fitted(saved: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`saved` in `like`'s dtype and shape: a vocabulary padded otherwise keeps its rows."""
    if tuple(saved.shape) == tuple(like.shape):
        return saved.to(like.dtype)
    out = torch.zeros(like.shape, dtype=like.dtype)
    rows = min(saved.shape[0], like.shape[0])
    out[:rows] = saved[:rows]
    return out


def _checkpoint_reader(directory: Path, rounded: torch.dtype | None):
    """(`read` for `_streamed` over our model, `load`: keys -> saved tensors): each module's
    weights (and saved expert biases) read alone from the checkpoint iteration `directory`,
    the weights rounded to `rounded` (None: as saved)."""
    import torch.distributed.checkpoint as dcp

    from megatrain.checkpoint.dcp import STATE_BUFFERS

    path = directory / "model"
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata

    def load(keys: list[str]) -> dict:
        missing = [k for k in keys if k not in saved]
        if missing:
            raise VerifyError(f"{path}: no saved tensor {missing[0]!r}")
        state = {k: torch.empty(tuple(saved[k].size), dtype=saved[k].properties.dtype)
                 for k in keys}  # fmt: skip
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path, no_dist=True)
        if rounded is not None:
            state = {k: t if k.endswith(STATE_BUFFERS) else t.to(rounded) for k, t in state.items()}
        return state

    def read(name: str, module: nn.Module) -> dict:
        full = f"{name}." if name else ""
        wanted = dict(module.named_parameters(remove_duplicate=False))
        wanted |= {n: b for n, b in module.named_buffers()
                   if n.endswith(STATE_BUFFERS) and full + n in saved}  # fmt: skip
        state = load([full + n for n in wanted])
        return {n: _fitted(state[full + n], like) for n, like in wanted.items()}

    return read, load


def run_hf(hf_dir: Path, tokens: torch.Tensor, dtype, streamed: bool, rounded=None):
    """transformers' logits [b, s, V] and each decoder layer's output (eager attention and
    experts), run in `dtype`, the weights first rounded to `rounded` (as an import in that
    dtype rounds them; None: as the files hold them)."""
    import transformers

    new = int(transformers.__version__.split(".")[0]) >= 5
    kwargs = {"attn_implementation": "eager", ("dtype" if new else "torch_dtype"): dtype}
    if new:  # both ways: the whole model's default (batched) experts round otherwise
        kwargs["experts_implementation"] = "eager"
    loaded = {**kwargs, ("dtype" if new else "torch_dtype"): rounded or dtype}
    if streamed:
        config = transformers.AutoConfig.from_pretrained(hf_dir)
        with _params_on_meta():
            model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        model = _params_to(
            transformers.AutoModelForCausalLM.from_pretrained(hf_dir, **loaded), dtype
        )
    model.eval()
    n = model.config.num_hidden_layers  # the decoder layers: `model.layers`, GPT-2's `h`
    lists = [name for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) == n]  # fmt: skip
    if not lists:
        raise VerifyError(f"{type(model).__name__}: no list of {n} decoder layers found")
    layers = [f"{lists[0]}.{i}" for i in range(n)]
    stream = _streamed(model, layers, _hf_reader(model, hf_dir, rounded)) if streamed else None
    call = lambda: model(input_ids=tokens, use_cache=False).logits  # noqa: E731
    return _forward(model, layers, False, stream or contextlib.nullcontext(), call)


def run_ours(ckpt, directory: Path, meta: dict, tokens, dtype, streamed: bool, rounded=None):
    """Our logits [b, s, padded V] and each layer's output, the model of the checkpoint run in
    `dtype`, its weights first rounded to `rounded` (as an export in that dtype rounds them;
    None: as saved)."""
    from megatrain.inference.load import checkpoint_model_config, load_model, model_kind
    from megatrain.models import build_model_chunks
    from megatrain.parallelize import parallelize_model

    cpu, stream = torch.device("cpu"), contextlib.ExitStack()
    if streamed:
        with _params_on_meta():
            chunks = build_model_chunks(
                model_kind(meta), checkpoint_model_config(meta), device=cpu, dtype=dtype,
                initialize=False,
            )  # fmt: skip
        model = parallelize_model(chunks)[0].eval()
        read, load = _checkpoint_reader(directory, rounded)

        def tied(module, args, kwargs):  # the tied output layer's word embeddings
            w = kwargs.get("weight")
            if w is not None and w.is_meta:
                kwargs["weight"] = _fitted(load(["embedding.weight"])["embedding.weight"], w)
            return args, kwargs

        stream.callback(model.output_layer.register_forward_pre_hook(tied, with_kwargs=True).remove)
    else:
        model = _params_to(load_model(ckpt, cpu, rounded or dtype).chunks[0], dtype)
    layers = [f"layers.{i}" for i in model.layer_ids]
    if streamed:
        stream.enter_context(_streamed(model, layers, read))
    return _forward(model, layers, True, stream, lambda: model(tokens).transpose(0, 1))
