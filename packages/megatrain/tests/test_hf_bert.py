"""Hugging Face export/import of our BERT, both block orders, against transformers'
MegatronBertForPreTraining ("pre_ln") and BertForPreTraining ("post_ln").

One process (a gloo world of one, tp = pp = 1): a tiny BERT with every weight perturbed (layer
norms and biases too, so a swapped or misplaced tensor shows) is written as a checkpoint,
exported, loaded by transformers and compared (masked-LM logits on the true vocabulary, SOP /
NSP logits, with padded positions), imported back tensor for tensor; a random transformers
model is imported and run by `megatrain.inference.load_model`; bad inputs are refused.
"""

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from tokenizers import Tokenizer

from megacore import parallel_state as ps
from megatrain.checkpoint.convert import write_checkpoint
from megatrain.checkpoint.dcp import named_params
from megatrain.checkpoint.files import MODEL_FIELDS, find_checkpoint, read_meta
from megatrain.checkpoint.load import read_full_state
from megatrain.cli import main
from megatrain.config import load_config
from megatrain.hf import import_hf
from megatrain.models import model_config
from megatrain.testing import write_bert_text_corpus

ORDERS = ("pre_ln", "post_ln")
HF_CLASSES = {"pre_ln": "MegatronBertForPreTraining", "post_ln": "BertForPreTraining"}
CONFIG_CLASSES = {"pre_ln": "MegatronBertConfig", "post_ln": "BertConfig"}
WORDS = (  # noqa: SIM905 (a sentence reads better than a list of strings)
    "the a model layer of tensor pipeline data parallel train loss token head weight "
    "gradient batch shard rank group step learning rate attention embedding vocabulary"
).split()
TEXT = "The gradient of the Attention layer: rank-group shard, step twelve!"
SEQ, BATCH = 16, 3


def _texts(rng, n):
    return [
        " ".join(" ".join(rng.choice(WORDS, rng.integers(4, 10))) + "." for _ in range(3))
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """tp = pp = 1 in this process: a gloo world of one."""
    created = not dist.is_initialized()
    if created:
        rendezvous = tmp_path_factory.mktemp("rendezvous") / "file"
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{rendezvous}")
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A bert-wordpiece corpus whose WordPiece vocabulary is under 128 tokens, so our
    embeddings have padding rows."""
    root, tok, _ = write_bert_text_corpus(
        tmp_path_factory.mktemp("corpus"), _texts(np.random.default_rng(0), 40), vocab_size=100
    )
    vocab = tok.get_vocab_size(with_added_tokens=True)
    assert 60 < vocab < 128
    return root, tok, vocab


def _inputs(vocab):
    """[b, s] tokens, token types (A then B) and a padding mask with padded positions."""
    rng = np.random.default_rng(5)
    tokens = torch.from_numpy(rng.integers(0, vocab, (BATCH, SEQ)))
    types = torch.zeros(BATCH, SEQ, dtype=torch.long)
    types[:, 7:] = 1
    lengths = torch.tensor([SEQ, 11, 6])
    mask = torch.arange(SEQ)[None, :] < lengths[:, None]
    types[~mask] = 0
    return tokens, types, mask


def _ours(model, vocab):
    """(MLM logits [b, s, vocab], SOP logits [b, 2]) of our BERT on `_inputs`."""
    with torch.no_grad():
        mlm, sop = model(*_inputs(vocab))
    assert torch.isneginf(mlm[:, :, vocab:]).all()  # the padding rows
    return mlm[:, :, :vocab].transpose(0, 1), sop


def _theirs(model, vocab):
    tokens, types, mask = _inputs(vocab)
    with torch.no_grad():
        out = model(input_ids=tokens, token_type_ids=types, attention_mask=mask.long())
    return out.prediction_logits, out.seq_relationship_logits


def _load_hf(hf_dir, order):
    import transformers

    model, info = getattr(transformers, HF_CLASSES[order]).from_pretrained(
        hf_dir, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _assert_close(ours, theirs):
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max() < 1e-4
        assert a.std() > 0.1  # perturbed weights: a real test of every tensor's place


def _run_config(root, order, out):
    return load_config(
        None,
        [f"data.corpus={str(root)!r}", f"training.output_dir={str(out)!r}", 'model.kind="bert"',
         f"model.block_order={order!r}", "model.num_layers=2", "model.hidden_size=32",
         "model.num_attention_heads=4", "model.max_position_embeddings=16",
         "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
         "model.layernorm_epsilon=1e-12", "training.seq_length=16"],
    )  # fmt: skip


@pytest.fixture(scope="module", params=ORDERS)
def exported(request, one_process, corpus, tmp_path_factory):
    """A tiny BERT of that block order, every weight perturbed, saved as a checkpoint and
    exported with `megatrain export-hf`: (order, model, weights, checkpoint, hf directory)."""
    from megatrain.models import build_bert_chunks

    order = request.param
    root, _, vocab = corpus
    out = tmp_path_factory.mktemp(f"bert-{order}")
    config = _run_config(root, order, out / "run")
    cfg = model_config(config, vocab)
    assert cfg.vocab_size == 128 and cfg.block_order == order
    model = build_bert_chunks(cfg, seed=11)[0].eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=generator))
        model.embedding.weight[vocab:] = 0  # padding rows stay zero
        model.lm_bias[vocab:] = 0
    weights = {n: p.detach().clone() for n, p in named_params([model]).items()}
    manifest = json.loads((root / "manifest.json").read_text())
    meta = {
        "iteration": 7,
        "model": {k: getattr(cfg, k) for k in MODEL_FIELDS},
        "padded_vocab_size": cfg.vocab_size,
        "vocab_size": vocab,
        "tokenizer": manifest["tokenizer"],
        "layout": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1},
        "config": config.to_dict(),
        "data": None,
        "optimizer": None,
        "dtype": "float32",
    }
    ckpt = out / "ckpt"
    write_checkpoint(ckpt, meta, weights, None, (root / "tokenizer.json").read_bytes())
    hf_dir = out / "hf"
    result = CliRunner().invoke(main, ["export-hf", "--ckpt", str(ckpt), "--out", str(hf_dir)])
    assert result.exit_code == 0, result.output
    return order, model, weights, ckpt, hf_dir


def test_export_loads_in_transformers_with_our_logits(exported, corpus):
    order, model, _, _, hf_dir = exported
    _, _, vocab = corpus
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == [HF_CLASSES[order]]
    assert config["model_type"] == {"pre_ln": "megatron-bert", "post_ln": "bert"}[order]
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (
        vocab, 32, 2
    )  # fmt: skip
    assert (config["num_attention_heads"], config["intermediate_size"]) == (4, 128)
    assert (config["max_position_embeddings"], config["type_vocab_size"]) == (16, 2)
    assert config["hidden_act"] == "gelu" and config["layer_norm_eps"] == 1e-12
    _assert_close(_ours(model, vocab), _theirs(_load_hf(hf_dir, order), vocab))


def test_export_tokenizer_loads_in_transformers(exported, corpus):
    from transformers import AutoTokenizer, BertTokenizerFast

    _, _, _, _, hf_dir = exported
    root, tok, vocab = corpus
    assert (hf_dir / "tokenizer.json").read_bytes() == (root / "tokenizer.json").read_bytes()
    lines = (hf_dir / "vocab.txt").read_text().splitlines()
    assert len(lines) == vocab and all(tok.token_to_id(t) == i for i, t in enumerate(lines))
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    assert len(ids) > 10
    second = tok.encode("rank group", add_special_tokens=False).ids
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    for loader in (AutoTokenizer, BertTokenizerFast):
        theirs = loader.from_pretrained(hf_dir)
        assert theirs.encode(TEXT) == [cls, *ids, sep]
        assert theirs.pad_token_id == tok.token_to_id("[PAD]")
        assert theirs.mask_token_id == tok.token_to_id("[MASK]")
        pair = theirs(TEXT, "rank group")
        assert pair["input_ids"] == [cls, *ids, sep, *second, sep]
        assert pair["token_type_ids"] == [0] * (len(ids) + 2) + [1] * (len(second) + 1)


def test_import_of_the_export_is_the_same_checkpoint(exported, corpus, tmp_path):
    order, _, weights, ckpt, hf_dir = exported
    root, tok, vocab = corpus
    directory = import_hf(hf_dir, tmp_path / "back")
    meta, state = read_full_state(tmp_path / "back", progress=False)
    assert state.keys() == weights.keys()
    for name, t in weights.items():
        assert state[name].dtype == t.dtype and torch.equal(state[name], t), name
    model = meta["config"]["model"]
    assert (model["kind"], model["block_order"]) == ("bert", order)
    assert meta["model"] == read_meta(find_checkpoint(ckpt))["model"]
    assert (meta["vocab_size"], meta["padded_vocab_size"], meta["iteration"]) == (vocab, 128, 0)
    assert meta["optimizer"] is None
    info = meta["tokenizer"]
    assert (info["kind"], info["eod_id"]) == ("bert-wordpiece", tok.token_to_id("[SEP]"))
    # Built from the export's vocab.txt: the same ids as the corpus's tokenizer.
    ours = Tokenizer.from_file(str(directory / "tokenizer.json"))
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    assert ours.encode(TEXT, add_special_tokens=False).ids == ids
    assert ours.encode(TEXT).ids == [tok.token_to_id("[CLS]"), *ids, tok.token_to_id("[SEP]")]
    assert hashlib.sha256((directory / "tokenizer.json").read_bytes()).hexdigest() == info["sha256"]
    # The corpus's tokenizer.json given: kept byte for byte, so fine-tuning on it passes.
    import_hf(hf_dir, tmp_path / "kept", tokenizer_file=root / "tokenizer.json")
    kept = read_meta(find_checkpoint(tmp_path / "kept"))
    manifest = json.loads((root / "manifest.json").read_text())
    assert kept["tokenizer"]["sha256"] == manifest["tokenizer"]["sha256"]


def test_vocab_txt_builds_megadatas_tokenizer(exported, tmp_path):
    """A tokenizer.json built from vocab.txt is megadata's for that vocab.txt, byte for byte:
    a corpus made from the same vocab.txt has its sha256."""
    megadata_tokenizer = pytest.importorskip("megadata.tokenizer")
    _, _, _, _, hf_dir = exported
    directory = import_hf(hf_dir, tmp_path / "ckpt", tokenizer_file=hf_dir / "vocab.txt")
    built = megadata_tokenizer.build_tokenizer(
        {"kind": "bert-wordpiece", "vocab": str(hf_dir / "vocab.txt")}, [], hf_dir
    )
    assert (directory / "tokenizer.json").read_bytes() == built.to_str().encode()


def _write_vocab(tok, hf_dir, lowercase=True):
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    (hf_dir / "vocab.txt").write_text("".join(by_id[i] + "\n" for i in range(len(by_id))))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": lowercase}))


@pytest.fixture(scope="module", params=ORDERS)
def random_hf(request, corpus, tmp_path_factory):
    """A transformers-made random *ForPreTraining of another shape, every weight perturbed,
    saved with save_pretrained, with the corpus's vocabulary as vocab.txt."""
    import transformers

    order = request.param
    _, tok, vocab = corpus
    out = tmp_path_factory.mktemp(f"random-{order}")
    config = getattr(transformers, CONFIG_CLASSES[order])(
        vocab_size=vocab, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=96, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=tok.token_to_id("[PAD]"),
        initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, HF_CLASSES[order])(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    _write_vocab(tok, out)
    return order, out


def test_import_of_a_random_hf_model_gives_its_logits(random_hf, corpus, one_process, tmp_path):
    from megatrain.inference.load import load_model

    order, hf_dir = random_hf
    _, _, vocab = corpus
    import_hf(hf_dir, tmp_path / "ckpt")
    loaded = load_model(tmp_path / "ckpt", torch.device("cpu"), kind="bert")
    assert loaded.config.block_order == order and loaded.config.hidden_size == 48
    assert loaded.config.vocab_size == 128 and loaded.config.true_vocab_size == vocab
    _assert_close(_ours(loaded.chunks[0], vocab), _theirs(_load_hf(hf_dir, order), vocab))


def test_import_reads_an_old_style_pytorch_bin(random_hf, tmp_path):
    """pytorch_model.bin as older transformers and TF-converted checkpoints hold it: LayerNorm
    gamma / beta, the position_ids buffer, the tied decoder stored: the same weights."""
    from safetensors.torch import load_file

    _, hf_dir = random_hf
    import_hf(hf_dir, tmp_path / "from-safetensors")
    _, expected = read_full_state(tmp_path / "from-safetensors", progress=False)
    bin_dir = tmp_path / "bin"
    shutil.copytree(hf_dir, bin_dir)
    state = load_file(str(bin_dir / "model.safetensors"))
    (bin_dir / "model.safetensors").unlink()
    old = {}
    for name, t in state.items():
        if "LayerNorm" in name or name.endswith(".ln.weight") or name.endswith(".ln.bias"):
            name = name.replace(".weight", ".gamma").replace(".bias", ".beta")
        old[name] = t
    old["bert.embeddings.position_ids"] = torch.arange(32)[None]
    old["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    old["cls.predictions.decoder.bias"] = state["cls.predictions.bias"]
    torch.save(old, bin_dir / "pytorch_model.bin")
    import_hf(bin_dir, tmp_path / "from-bin")
    _, found = read_full_state(tmp_path / "from-bin", progress=False)
    assert found.keys() == expected.keys()
    assert all(torch.equal(found[n], expected[n]) for n in found)

    old["cls.predictions.decoder.weight"] = old["cls.predictions.decoder.weight"] + 1
    torch.save(old, bin_dir / "pytorch_model.bin")
    result = _invoke("import-hf", str(bin_dir), "--out", str(tmp_path / "untied"))
    assert result.exit_code == 2
    assert "cls.predictions.decoder.weight differs from bert.embeddings" in result.output


def _invoke(*args):
    return CliRunner().invoke(main, list(args))


def _variant(source, out, config=None, drop=()):
    shutil.copytree(source, out)
    if config:
        data = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**data, **config}))
    for name in drop:
        (out / name).unlink()
    return out


def test_bad_hf_input_is_refused_with_the_file_and_field(random_hf, corpus, tmp_path):
    import transformers

    order, hf_dir = random_hf
    _, tok, _ = corpus
    for field, value, message in (
        ("hidden_act", "relu", "hidden_act is 'relu', expected 'gelu'"),
        ("hidden_act", "gelu_new", "hidden_act is 'gelu_new'"),
        ("position_embedding_type", "relative_key", "position_embedding_type is 'relative_key'"),
        ("is_decoder", True, "is_decoder is True"),
        ("add_cross_attention", True, "add_cross_attention is True"),
        ("tie_word_embeddings", False, "tie_word_embeddings is False"),
        ("type_vocab_size", 3, "type_vocab_size is 3, expected 2"),
        ("num_attention_heads", 5, "hidden_size (48) is not divisible by num_attention_heads"),
    ):
        bad = _variant(hf_dir, tmp_path / f"bad-{field}-{value}", {field: value})
        result = _invoke("import-hf", str(bad), "--out", str(tmp_path / "y"))
        assert result.exit_code == 2 and message in result.output, (field, result.output)
        assert "config.json" in result.output
    bad = _variant(hf_dir, tmp_path / "bad-shape", {"intermediate_size": 64})
    result = _invoke("import-hf", str(bad), "--out", str(tmp_path / "y"))
    assert result.exit_code == 2 and "intermediate.dense.weight has shape (96, 48)" in result.output

    # Without the pre-training heads (a BertForMaskedLM: no pooler, no NSP head).
    masked_lm = tmp_path / "masked-lm"
    mlm_class = {"pre_ln": "MegatronBertForMaskedLM", "post_ln": "BertForMaskedLM"}[order]
    config_class = getattr(transformers, CONFIG_CLASSES[order])
    getattr(transformers, mlm_class)(config_class.from_pretrained(hf_dir)).save_pretrained(
        masked_lm
    )
    _write_vocab(tok, masked_lm)
    result = _invoke("import-hf", str(masked_lm), "--out", str(tmp_path / "y"))
    assert result.exit_code == 2 and "missing ['bert.pooler.dense.bias'" in result.output
    assert "needs the pre-training heads" in result.output and mlm_class in result.output

    # Tokenizers: none, another size, without BERT's special tokens, not WordPiece.
    result = _invoke("import-hf", str(_variant(hf_dir, tmp_path / "no-tok", drop=["vocab.txt"])),
                     "--out", str(tmp_path / "y"))  # fmt: skip
    assert result.exit_code == 2 and "no tokenizer; expected vocab.txt" in result.output
    longer = _variant(hf_dir, tmp_path / "longer", drop=["vocab.txt"])
    (longer / "vocab.txt").write_text((hf_dir / "vocab.txt").read_text() + "extra\n")
    result = _invoke("import-hf", str(longer), "--out", str(tmp_path / "y"))
    assert result.exit_code == 2 and "but the tokenizer" in result.output
    assert "our vocabulary is the tokenizer's" in result.output
    no_mask = _variant(hf_dir, tmp_path / "no-mask", drop=["vocab.txt"])
    (no_mask / "vocab.txt").write_text(
        (hf_dir / "vocab.txt").read_text().replace("[MASK]\n", "[MAZK]\n")
    )
    result = _invoke("import-hf", str(no_mask), "--out", str(tmp_path / "y"))
    assert result.exit_code == 2 and "vocabulary has no [MASK]" in result.output
    gpt_tokenizer = tmp_path / "bpe.json"
    from tokenizers import models

    Tokenizer(models.BPE()).save(str(gpt_tokenizer))
    result = _invoke("import-hf", str(hf_dir), "--out", str(tmp_path / "y"), "--tokenizer",
                     str(gpt_tokenizer))  # fmt: skip
    assert (
        result.exit_code == 2 and "model.type is 'BPE'; a BERT needs a WordPiece" in result.output
    )
    assert not (tmp_path / "y").exists()


def test_bad_checkpoint_is_refused_on_export(exported, tmp_path):
    _, _, _, ckpt, _ = exported
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    meta_file = find_checkpoint(bad) / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["tokenizer"]["kind"] = "gpt2-bpe"
    meta_file.write_text(json.dumps(meta))
    result = _invoke("export-hf", "--ckpt", str(bad), "--out", str(tmp_path / "x"))
    assert result.exit_code == 2 and "meta.json" in result.output
    assert "expected kind 'bert-wordpiece' for a BERT" in result.output
