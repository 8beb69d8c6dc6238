"""import-hf and export-hf a tensor at a time, at the size people use: HF's sharded files read
through their index, our checkpoint written as each tensor (each expert) is made, exports in
shards as transformers writes them (`--max-shard-size`), the files' dtype kept, and every file
or tensor that is missing, extra or truncated named.  Peak memory is measured by
benchmarks/bench_hf_convert.py, not here."""

import copy
import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_hf_llama_families import VOCAB, random_hf

from megatrain.checkpoint.files import find_checkpoint
from megatrain.checkpoint.load import read_full_state
from megatrain.hf import HFFormatError, export_hf, import_hf
from megatrain.hf.shards import parse_shard_size, plan_shards

MIXTRAL = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A random Mixtral (the experts are most of its bytes) saved whole and in shards of
    30 KB, in fp32 and bf16, each imported."""
    root = tmp_path_factory.mktemp("streaming")
    hf = random_hf(root / "whole", "mixtral", **MIXTRAL)
    hf.save_pretrained(root / "sharded", max_shard_size="30KB")
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(root / "bf16", max_shard_size="30KB")
    for name in ("sharded", "bf16"):
        shutil.copy(root / "whole" / "tokenizer.json", root / name)
    for name in ("whole", "sharded", "bf16"):
        import_hf(root / name, root / f"{name}-ckpt")
    import_hf(root / "bf16", root / "bf16-as-fp32-ckpt", dtype="float32")
    return root, hf


def test_sharded_files_import_as_the_whole_file_does(models):
    root, _ = models
    assert len(list((root / "sharded").glob("model-*.safetensors"))) > 3
    _, whole = read_full_state(root / "whole-ckpt", progress=False)
    _, sharded = read_full_state(root / "sharded-ckpt", progress=False)
    assert whole.keys() == sharded.keys()
    for name, t in whole.items():
        assert torch.equal(t, sharded[name]), name
    # Written a piece at a time: a stacked expert tensor one expert a piece.
    directory = find_checkpoint(root / "sharded-ckpt") / "model"
    metadata = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    chunks = metadata["layers.0.mlp.experts.weight1"].chunks
    assert [tuple(c.offsets) for c in chunks] == [(e, 0, 0) for e in range(4)]
    assert all(tuple(c.sizes) == (1, 32, 32) for c in chunks)


def test_bf16_stays_bf16_unless_asked(models):
    root, _ = models
    meta, bf16 = read_full_state(root / "bf16-ckpt", progress=False)
    assert meta["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    meta, fp32 = read_full_state(root / "bf16-as-fp32-ckpt", progress=False)
    assert meta["dtype"] == "float32" and all(t.dtype == torch.float32 for t in fp32.values())
    for name, t in bf16.items():
        assert torch.equal(t.float(), fp32[name]), name


def test_sharded_export_loads_in_transformers_and_equals_the_whole_one(models):
    import transformers

    root, hf = models
    export_hf(root / "whole-ckpt", root / "export-whole", progress=False)
    export_hf(root / "whole-ckpt", root / "export-sharded", progress=False, max_shard_size="20KB")
    assert (root / "export-whole" / "model.safetensors").is_file()
    assert not (root / "export-whole" / "model.safetensors.index.json").exists()
    shards = sorted(p.name for p in (root / "export-sharded").glob("model-*.safetensors"))
    n = len(shards)
    assert n > 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((root / "export-sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    sizes = sum((root / "export-sharded" / s).stat().st_size for s in shards)
    assert 0 < index["metadata"]["total_size"] < sizes
    loaded = {}
    for name in ("export-whole", "export-sharded"):
        loaded[name] = transformers.AutoModelForCausalLM.from_pretrained(
            root / name, attn_implementation="eager", experts_implementation="eager"
        ).eval()
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole, sharded, theirs = (m(tokens).logits for m in (*loaded.values(), hf))
    assert torch.equal(whole, sharded)
    assert (whole - theirs).abs().max() < 1e-4
    # A pool of two workers, each writing its share of the shards: the same files, byte for byte.
    export_hf(root / "whole-ckpt", root / "export-pool", "float32", False, "20KB", workers=2)
    pool = sorted(p.name for p in (root / "export-pool").glob("model*"))
    assert pool == [*shards, "model.safetensors.index.json"]
    for name in pool:
        a, b = (root / d / name for d in ("export-pool", "export-sharded"))
        assert a.read_bytes() == b.read_bytes(), name
    # bf16 files export as bf16 when asked, and as fp32 by default (the weights' values kept).
    export_hf(root / "bf16-ckpt", root / "export-bf16", "bfloat16", False, "40KB")
    back = transformers.AutoModelForCausalLM.from_pretrained(root / "export-bf16")
    assert next(back.parameters()).dtype == torch.bfloat16


def test_shard_sizes_read_as_transformers_reads_them():
    assert parse_shard_size("5GB") == 5 * 10**9 and parse_shard_size("2GiB") == 2 * 2**30
    assert parse_shard_size("500MB") == 500 * 10**6 and parse_shard_size(1234) == 1234
    assert parse_shard_size("8Gb") == 10**9 and parse_shard_size("10KiB") == 10240
    for bad in ("five", "0MB", "-1", 0):
        with pytest.raises(ValueError, match="--max-shard-size"):
            parse_shard_size(bad)
    # A tensor larger than the limit has a file of its own; the others fill files in order.
    plan = plan_shards([("a", (10,)), ("b", (100,)), ("c", (5,)), ("d", (5,))], torch.float32, 60)
    assert list(plan.values()) == [[("a", (10,))], [("b", (100,))], [("c", (5,)), ("d", (5,))]]


def test_missing_extra_and_truncated_files_are_named(models, tmp_path):
    root, _ = models
    index_name = "model.safetensors.index.json"

    def copy(name: str):
        target = tmp_path / name
        shutil.copytree(root / "sharded", target)
        return target

    gone = copy("gone")
    index = json.loads((gone / index_name).read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (gone / shard).unlink()
    with pytest.raises(HFFormatError, match=f"{index_name} lists {shard}, not in .*download"):
        import_hf(gone, tmp_path / "c1")

    cut = copy("cut")
    data = (cut / shard).read_bytes()
    (cut / shard).write_bytes(data[: len(data) - 100])
    with pytest.raises(HFFormatError, match=f"{shard}: cannot be read as safetensors.*truncated"):
        import_hf(cut, tmp_path / "c2")

    from safetensors.torch import load_file, save_file

    extra = copy("extra")
    tensors = load_file(extra / shard)
    missing_name = next(iter(tensors))
    tensors["model.layers.0.mystery.weight"] = torch.zeros(3)
    save_file({k: v for k, v in tensors.items() if k != missing_name}, extra / shard)
    with pytest.raises(HFFormatError) as refused:
        import_hf(extra, tmp_path / "c3")
    assert "unexpected ['model.layers.0.mystery.weight']" in str(refused.value)
    assert f"missing ['{missing_name}']" in str(refused.value)
    for n in ("c1", "c2", "c3"):  # refused before anything was written
        assert not (tmp_path / n).exists()


def test_the_commands_take_dtype_shard_size_and_refuse_a_bad_one(models, tmp_path):
    from click.testing import CliRunner

    from megatrain.cli import main

    root, _ = models
    runner = CliRunner()
    done = runner.invoke(main, ["import-hf", str(root / "sharded"), "--out", str(tmp_path / "c"),
                                "--dtype", "bfloat16"])  # fmt: skip
    assert done.exit_code == 0, done.output
    assert read_full_state(tmp_path / "c", progress=False)[0]["dtype"] == "bfloat16"
    done = runner.invoke(main, ["export-hf", "--ckpt", str(tmp_path / "c"), "--out",
                                str(tmp_path / "e"), "--max-shard-size", "20KB"])  # fmt: skip
    assert done.exit_code == 0, done.output
    assert (tmp_path / "e" / "model.safetensors.index.json").is_file()
    bad = runner.invoke(main, ["export-hf", "--ckpt", str(tmp_path / "c"), "--out",
                               str(tmp_path / "f"), "--max-shard-size", "lots"])  # fmt: skip
    assert bad.exit_code != 0 and "--max-shard-size 'lots'" in bad.output
    assert not (tmp_path / "f").exists()
