"""Quantized Hugging Face files read as they are (`hf.quantized`): DeepSeek's block-scaled FP8
and OpenAI's MXFP4, dequantised tensor by tensor inside the streamed reader.

Small safetensors files written here, with odd sizes so the FP8 edge blocks are partial (a
576-row weight holds 4.5 blocks of 128 rows, as DeepSeek-V3's kv_a_proj_with_mqa): what the
headers report, whole tensors equal transformers' own dequantisers exactly, any box read
equals the slice of the whole and reads only the stored blocks it meets (its bytes counted),
`modules_to_not_convert` kept as stored, each refusal naming the file and tensor or field.
End to end: a Llama and a Mixtral stored with FP8 linears (their scales in a shard of their
own) import as the files of their dequantised weights do, and `run --load-hf` of them at tp 2
and ep 2 takes the same steps as from those files.
"""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hf_llama_families import random_hf

from megatrain.hf import HFFormatError, quantized
from megatrain.hf.decoder import read_headers
from megatrain.hf.quantized import read_quantization, should_convert
from megatrain.hf.tensor_map import HFFiles, read_box, whole

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [128, 128]}  # fmt: skip
MXFP4 = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.1.mlp.experts"],
}


def fp8_quantized(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block) as DeepSeek's quantizer makes them:
    each block scaled by its max |w| / 448, the edge blocks partial."""
    (R, C), (b0, b1) = w.shape[-2:], block
    gr, gc = math.ceil(R / b0), math.ceil(C / b1)
    padded = torch.zeros(*w.shape[:-2], gr * b0, gc * b1)
    padded[..., :R, :C] = w
    blocks = padded.unflatten(-1, (gc, b1)).unflatten(-3, (gr, b0))  # [.., gr, b0, gc, b1]
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / 448
    q = (blocks / scale[..., :, None, :, None]).reshape(padded.shape)[..., :R, :C]
    return q.to(torch.float8_e4m3fn), scale.float()


def write_files(directory, tensors: dict, quantization: dict | None, dtype="bfloat16", split=()):
    """config.json (a Llama's few fields, `quantization_config`) and the tensors: one
    model.safetensors, or, when `split` names some, those in a second shard with an index."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "dtype": dtype}
    if quantization is not None:
        config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config))
    if not split:
        save_file(tensors, directory / "model.safetensors")
        return
    parts = {"a.safetensors": {k: v for k, v in tensors.items() if k not in split},
             "b.safetensors": {k: v for k, v in tensors.items() if k in split}}  # fmt: skip
    for name, part in parts.items():
        save_file(part, directory / name)
    weight_map = {k: f for f, part in parts.items() for k in part}
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def headers_of(directory):
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    c = {"tied": False, "model_type": "llama",
         "quantization": read_quantization(config_file, config)}  # fmt: skip
    return read_headers(directory, c)


def files_of(directory):
    headers = headers_of(directory)
    return headers, HFFiles(directory, headers.where, quantized=headers.quantized)


def random_fp8(shape, block, seed):
    g = torch.Generator().manual_seed(seed)
    return fp8_quantized(torch.randn(shape, generator=g) * 0.05, block)


@pytest.fixture(scope="module")
def fp8_files(tmp_path_factory):
    """DeepSeek-shaped FP8 weights in blocks of 128: 576 x 200 (both edges partial), 256 x 384
    (whole blocks), 3 x 130 x 129 (experts stacked, partial); a bf16 norm beside them."""
    root = tmp_path_factory.mktemp("fp8")
    shapes = {"kv_a_proj_with_mqa": (576, 200), "o_proj": (256, 384), "experts": (3, 130, 129)}
    tensors, stored = {}, {}
    for i, (name, shape) in enumerate(shapes.items()):
        w, s = random_fp8(shape, (128, 128), i)
        tensors[f"model.{name}.weight"], tensors[f"model.{name}.weight_scale_inv"] = w, s
        stored[f"model.{name}.weight"] = (w, s)
    tensors["model.norm.weight"] = torch.randn(200).to(torch.bfloat16)
    for dtype in ("bfloat16", "float32"):
        write_files(root / dtype, tensors, FP8, dtype=dtype)
    return root, stored, tensors


def test_fp8_headers_report_the_dequantised_tensors(fp8_files):
    root, stored, tensors = fp8_files
    headers = headers_of(root / "bfloat16")
    assert headers.shapes == {n: tuple(t.shape) for n, t in tensors.items() if "scale" not in n}
    assert set(headers.dtypes.values()) == {"BF16"}
    assert set(headers.quantized) == set(stored)
    assert headers_of(root / "float32").dtypes["model.o_proj.weight"] == "F32"
    # The bytes the files hold: each fp8 element one byte, each block's scale four.
    assert headers.stored_bytes() == sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_equals_transformers_dequantisation(fp8_files, dtype, monkeypatch):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    root, stored, tensors = fp8_files
    kind = getattr(torch, dtype)
    for chunk in (quantized.CHUNK, 1000):  # 1000: a band of one block row a pass
        monkeypatch.setattr(quantized, "CHUNK", chunk)
        _, files = files_of(root / dtype)
        for name, (w, s) in stored.items():
            ours = files.read(name, (0,) * w.dim(), tuple(w.shape))
            # transformers' dequantiser of partial blocks (its backward's), the product in fp32
            theirs = _dequantize_fp8_weight(w, s, [128, 128], torch.float32).to(kind)
            assert ours.dtype == kind and torch.equal(ours, theirs), name
            if all(n % 128 == 0 for n in w.shape[-2:]):  # its loader's needs whole blocks
                loaded = Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=kind)
                assert torch.equal(ours, loaded), name
        assert torch.equal(files.read("model.norm.weight", (0,), (200,)),
                           tensors["model.norm.weight"])  # fmt: skip
        files.close()


def test_fp8_boxes_read_only_the_blocks_they_meet(fp8_files):
    root, _, _ = fp8_files
    _, files = files_of(root / "bfloat16")
    name = "model.kv_a_proj_with_mqa.weight"
    full = files.read(name, (0, 0), (576, 200))
    g = torch.Generator().manual_seed(5)
    boxes = [((500, 0), (76, 200)), ((127, 127), (2, 2)), ((0, 0), (576, 200))]
    for _ in range(20):
        r0, c0 = (int(torch.randint(0, n, (1,), generator=g)) for n in (576, 200))
        nr, nc = int(torch.randint(1, 577 - r0, (1,), generator=g)), 200 - c0
        boxes.append(((r0, c0), (nr, int(torch.randint(1, nc + 1, (1,), generator=g)))))
    for (r0, c0), (nr, nc) in boxes:
        before = files.bytes_read
        box = files.read(name, (r0, c0), (nr, nc))
        assert torch.equal(box, full[r0 : r0 + nr, c0 : c0 + nc]), (r0, c0, nr, nc)
        blocks = (math.ceil((r0 + nr) / 128) - r0 // 128) * (math.ceil((c0 + nc) / 128) - c0 // 128)
        assert files.bytes_read - before == nr * nc + 4 * blocks
    # One expert of a stacked tensor, and a tensor map's box (rows, as a TP slice) of it.
    name = "model.experts.weight"
    experts = files.read(name, (0, 0, 0), (3, 130, 129))
    assert torch.equal(files.read(name, (1, 0, 0), (1, 130, 129)), experts[1:2])
    out = torch.empty(2, 60, 129, dtype=torch.float32)
    read_box(whole(name, (3, 130, 129)), files, (1, 70, 0), (2, 60, 129), out)
    assert torch.equal(out, experts[1:, 70:].float())
    files.close()


def random_mxfp4(E, R, G, seed, exponents=(118, 136)):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, R, G, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(*exponents, (E, R, G), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def mxfp4_files(tmp_path_factory):
    """gpt-oss-shaped experts (E 3, h 96, f 64): layer 0's gate_up_proj [E, 2f, h/32, 16]
    (scales near 127, one byte of 255 in expert 2) and down_proj [E, h, f/32, 16] (scales
    over 0..254: the subnormal 2 ** -127 too); layer 1's experts and every self_attn named in
    modules_to_not_convert."""
    root = tmp_path_factory.mktemp("mxfp4")
    E, h, f = 3, 96, 64
    tensors, packed = {}, {}
    layout = {"model.layers.0.mlp.experts.gate_up_proj": (2 * f, h // 32, (118, 136)),
              "model.layers.0.mlp.experts.down_proj": (h, f // 32, (0, 255)),
              "model.layers.1.mlp.experts.gate_up_proj": (2 * f, h // 32, (118, 136))}  # fmt: skip
    for i, (name, (rows, groups, exponents)) in enumerate(layout.items()):
        blocks, scales = random_mxfp4(E, rows, groups, i, exponents)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        packed[name] = (blocks, scales)
    packed["model.layers.0.mlp.experts.gate_up_proj"][1][2, 5, 1] = 255
    tensors["model.layers.0.mlp.experts.gate_up_proj_bias"] = torch.randn(E, 2 * f).bfloat16()
    tensors["model.layers.0.mlp.router.weight"] = torch.randn(E, h).bfloat16()
    # A tensor that looks packed but sits in a module kept as stored.
    tensors["model.layers.0.self_attn.sinks_blocks"] = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    tensors["model.layers.0.self_attn.sinks_scales"] = torch.zeros(1, 2, 1, dtype=torch.uint8)
    for dtype in ("bfloat16", "float32"):
        write_files(root / dtype, tensors, MXFP4, dtype=dtype)
    return root, packed, tensors


def test_mxfp4_headers_and_modules_kept_as_stored(mxfp4_files):
    root, _, tensors = mxfp4_files
    headers = headers_of(root / "bfloat16")
    assert set(headers.quantized) == {"model.layers.0.mlp.experts.gate_up_proj",
                                      "model.layers.0.mlp.experts.down_proj"}  # fmt: skip
    # HF's GptOssExperts: gate_up_proj [E, h, 2f], down_proj [E, f, h].
    assert headers.shapes["model.layers.0.mlp.experts.gate_up_proj"] == (3, 96, 128)
    assert headers.shapes["model.layers.0.mlp.experts.down_proj"] == (3, 64, 96)
    assert headers.dtypes["model.layers.0.mlp.experts.down_proj"] == "BF16"
    for kept in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.self_attn.sinks"):
        assert headers.dtypes[f"{kept}_blocks"] == headers.dtypes[f"{kept}_scales"] == "U8"
        assert kept not in headers.shapes
    assert headers.shapes["model.layers.0.mlp.router.weight"] == (3, 96)
    assert headers.stored_bytes() == sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mxfp4_equals_transformers_dequantisation(mxfp4_files, dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root, packed, _ = mxfp4_files
    headers, files = files_of(root / dtype)
    kind = getattr(torch, dtype)
    for name in headers.quantized:
        blocks, scales = packed[name]
        ours = files.read(name, (0, 0, 0), headers.shapes[name])
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=kind)
        assert ours.dtype == kind and ours.shape == theirs.shape, name
        # Exponent 128 (scale byte 255) is inf and 0 x inf nan on both sides.
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True, msg=name)
    files.close()


def test_mxfp4_boxes_read_only_their_experts_rows_and_blocks(mxfp4_files):
    root, _, _ = mxfp4_files
    _, files = files_of(root / "bfloat16")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    full = files.read(name, (0, 0, 0), (3, 96, 128))
    boxes = [((1, 0, 0), (1, 96, 128)), ((1, 5, 2), (2, 65, 7)), ((0, 31, 127), (3, 2, 1)),
             ((2, 64, 0), (1, 32, 128))]  # fmt: skip
    for (e0, h0, r0), (ne, nh, nr) in boxes:
        before = files.bytes_read
        box = files.read(name, (e0, h0, r0), (ne, nh, nr))
        assert torch.equal(box, full[e0 : e0 + ne, h0 : h0 + nh, r0 : r0 + nr])
        groups = math.ceil((h0 + nh) / 32) - h0 // 32
        assert files.bytes_read - before == ne * nr * groups * (16 + 1)
    files.close()


def test_module_patterns_match_transformers():
    from transformers.quantizers.quantizers_utils import should_convert_module

    patterns = ["model.layers.*.self_attn", "model.layers.1.mlp", "lm_head", "mlp.gate"]
    names = ["model.layers.11.self_attn", "model.layers.1.mlp.experts", "model.layers.11.mlp",
             "lm_head", "model.embed_tokens", "model.layers.0.mlp.gate",
             "model.layers.0.mlp.gate_proj", "model.layers.1.mlpx"]  # fmt: skip
    for name in names:
        assert should_convert(name, tuple(patterns)) == should_convert_module(name, patterns), name


def _refused(directory, match):
    with pytest.raises(HFFormatError, match=match):
        headers_of(directory)


def test_fp8_refusals_name_the_file_and_tensor(fp8_files, tmp_path):
    _, _, tensors = fp8_files
    bad = dict(tensors)
    bad["model.kv_a_proj_with_mqa.weight_scale_inv"] = torch.ones(4, 2)  # 576 rows need 5
    write_files(tmp_path / "grid", bad, FP8)
    _refused(
        tmp_path / "grid",
        r"grid/model.safetensors: model.kv_a_proj_with_mqa.weight_scale_inv has shape \(4, 2\); "
        r"model.kv_a_proj_with_mqa.weight \(576, 200\) in blocks of weight_block_size "
        r"\[128, 128\] needs \(5, 2\)",
    )
    write_files(tmp_path / "grid-64", tensors, {**FP8, "weight_block_size": [64, 128]})
    # The first the files hold: the stacked experts, 130 rows in 3 blocks of 64, not 2.
    _refused(
        tmp_path / "grid-64", r"experts.weight_scale_inv has shape \(3, 2, 2\).*needs \(3, 3, 2\)"
    )
    bad = {k: v for k, v in tensors.items() if k != "model.o_proj.weight_scale_inv"}
    write_files(tmp_path / "gone", bad, FP8)
    _refused(tmp_path / "gone", r"gone/model.safetensors: model.o_proj.weight is FP8 \(F8_E4M3\) "
             r"without its scale model.o_proj.weight_scale_inv")  # fmt: skip


def test_mxfp4_refusals_name_the_file_and_tensor(mxfp4_files, tmp_path):
    _, _, tensors = mxfp4_files
    name = "model.layers.0.mlp.experts.down_proj"
    bad = dict(tensors)
    bad[f"{name}_scales"] = torch.zeros(3, 96, 3, dtype=torch.uint8)
    write_files(tmp_path / "shape", bad, MXFP4, split=(f"{name}_scales",))
    _refused(tmp_path / "shape", rf"shape/b.safetensors: {name}_scales is U8 \(3, 96, 3\); the "
             rf"blocks {name}_blocks \(3, 96, 2, 16\) need U8 \(3, 96, 2\)")  # fmt: skip
    bad = {k: v for k, v in tensors.items() if k != f"{name}_scales"}
    write_files(tmp_path / "gone", bad, MXFP4)
    _refused(tmp_path / "gone", rf"{name}_blocks is MXFP4 without its scales {name}_scales")


@pytest.mark.parametrize(
    ("fields", "match"),
    [({"quant_method": "awq"}, r"quant_method is 'awq': read are fp8, mxfp4"),
     ({**FP8, "fmt": "e5m2"}, r"fmt is 'e5m2': only e4m3"),
     ({**FP8, "activation_scheme": "static"}, r"activation_scheme is 'static'"),
     ({**FP8, "weight_block_size": [128]}, r"weight_block_size is \[128\]: expected two positive")],
)  # fmt: skip
def test_quantization_config_refused_by_field(tmp_path, fields, match):
    from megatrain.hf.llama import read_hf_config

    config = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 32,
              "num_attention_heads": 4, "vocab_size": 96, "intermediate_size": 48,
              "quantization_config": fields}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFFormatError, match=rf"config.json: quantization_config\.{match}"):
        read_hf_config(tmp_path)  # config.json read; no weight file is there to read


# End to end: a Llama and a Mixtral with FP8 linears in blocks of 16 x 20 (partial in both
# dimensions of every matrix: hidden 32, kv rows 16, ffn 48).
E2E_BLOCK = [16, 20]
E2E = {
    "llama": {"num_key_value_heads": 2, "tie_word_embeddings": False},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16},
}


def quantized_pair(root, name: str, model_type: str, vocab: int | None = None, **overrides):
    """A random HF model's files stored as an FP8 checkpoint is (its linears' weights fp8 with
    scales, in a shard of their own; the rest bf16) in `root / name`, and as the bf16 files of
    its weights dequantised by transformers in `root / name-dequantised`."""
    fields = {"vocab_size": vocab} if vocab else {}
    random_hf(root / "hf", model_type, **fields, **overrides)
    config = json.loads((root / "hf" / "config.json").read_text())
    state = load_file(root / "hf" / "model.safetensors")
    fp8, plain = {}, {}
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    for key, t in state.items():
        if key.startswith("model.layers.") and t.dim() == 2 and "gate.weight" not in key:
            w, s = fp8_quantized(t, E2E_BLOCK)
            fp8[key], fp8[f"{key}_scale_inv"] = w, s
            plain[key] = _dequantize_fp8_weight(w, s, E2E_BLOCK, torch.float32).bfloat16()
        else:
            fp8[key] = plain[key] = t.bfloat16()
    config["dtype"] = "bfloat16"
    for out, tensors, quantization in ((name, fp8, FP8), (f"{name}-dequantised", plain, None)):
        directory = root / out
        directory.mkdir()
        write_files(directory, tensors, quantization, split=[k for k in tensors if "scale" in k])
        with_quant = {**config, **({"quantization_config": {**FP8, "weight_block_size":
                      E2E_BLOCK}} if quantization else {})}  # fmt: skip
        (directory / "config.json").write_text(json.dumps(with_quant))
        shutil.copy(root / "hf" / "tokenizer.json", directory)
    shutil.rmtree(root / "hf")
    return fp8


@pytest.mark.parametrize("model_type", list(E2E))
def test_fp8_files_import_as_their_dequantised_weights(tmp_path, model_type):
    from megatrain.checkpoint.load import read_full_state
    from megatrain.hf import import_hf

    fp8 = quantized_pair(tmp_path, "q", model_type, **E2E[model_type])
    assert sum(t.dtype == torch.float8_e4m3fn for t in fp8.values()) >= 7
    for source in ("q", "q-dequantised"):
        import_hf(tmp_path / source, tmp_path / f"{source}-ckpt")
    meta, ours = read_full_state(tmp_path / "q-ckpt", progress=False)
    _, reference = read_full_state(tmp_path / "q-dequantised-ckpt", progress=False)
    assert meta["dtype"] == "bfloat16" and meta["imported_from"]["dequantized_from"] == "fp8"
    assert ours.keys() == reference.keys()
    for name, t in reference.items():
        assert t.dtype == torch.bfloat16 and torch.equal(ours[name], t), name
    # A weight or scale refused before any checkpoint is written.
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "q", bad)
    scales = load_file(bad / "b.safetensors")
    key = next(k for k in scales if "down_proj" in k or ".w2." in k)
    scales[key] = scales[key][:1]
    save_file(scales, bad / "b.safetensors")
    with pytest.raises(HFFormatError, match=rf"bad/b.safetensors: {key} has shape"):
        import_hf(bad, tmp_path / "bad-ckpt")
    assert not (tmp_path / "bad-ckpt").exists()


def _load_hf_runs(root, out):
    """Rank 0's histories of `run --load-hf` at tp 2 (the Llama) and ep 2 (the Mixtral), from
    the FP8 files and from their dequantised ones."""
    from test_hf_load_layout import _config, _trained

    runs = {}
    for name, layout in (("llama", "parallel.tensor_model_parallel_size=2"),
                         ("mixtral", "parallel.expert_model_parallel_size=2")):  # fmt: skip
        for source in (name, f"{name}-dequantised"):
            load = [f"checkpoint.load_hf='{root}/{source}'", layout]
            runs[source] = _trained(_config(root, source, f"{out}/{source}", load))
    return runs


def test_load_hf_of_fp8_files_takes_the_steps_of_their_dequantised_weights(tmp_path):
    """`run --load-hf` at tp 2 and at ep 2 (2 gloo ranks): each rank dequantises only its
    boxes (row slices of q/kv/SwiGLU cutting the 16-row blocks, its experts) and the steps
    equal those from the dequantised files bit for bit, each rank reading fewer bytes."""
    import hashlib

    from test_hf_load_layout import VOCAB

    from megacore.testing import run_distributed
    from megatrain.testing import write_counting_corpus

    for name, overrides in E2E.items():
        quantized_pair(tmp_path, name, name, vocab=VOCAB, **overrides)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    for name in E2E:
        for source in (name, f"{name}-dequantised"):
            tokenizer.save(str(tmp_path / source / "tokenizer.json"))
    corpus = write_counting_corpus(tmp_path / "corpus", VOCAB)
    manifest = json.loads((corpus / "manifest.json").read_text())
    sha = hashlib.sha256((tmp_path / "llama" / "tokenizer.json").read_bytes()).hexdigest()
    manifest["tokenizer"]["sha256"] = sha
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    runs = run_distributed(_load_hf_runs, 2, args=(tmp_path, str(tmp_path / "out")), timeout=300)[0]
    for name in E2E:
        ours, reference = runs[name], runs[f"{name}-dequantised"]
        for key in ("loss", "grad_norm", "valid"):
            assert ours[key] == reference[key], (name, key)
        # Each rank read its quantized boxes as fp8 and their blocks' scales, not as bf16 (the
        # unit tests above count a box's bytes exactly).
        assert all(a < b for a, b in zip(ours["read"], reference["read"], strict=True)), name
