"""From a Hugging Face model to a run in one command, as docs/finetuning.md walks it: a random
4-layer `LlamaForCausalLM` with a tokenizer of its own, made here, imported with
`megatrain import-hf` (which writes `run.toml` beside the checkpoint); a corpus built by
`megadata run` from a jsonl file with that tokenizer (`tokenizer_json`); `megatrain run --load
CKPT data.corpus=...` at tp 2 on 2 gloo workers, the config taken from the checkpoint; then
`megaeval wikitext103` on the fine-tuned checkpoint and `megatrain export-hf`, which
transformers loads.

The run's first loss is the HF model's own on the run's first batch (so the imported weights
were loaded, at tp 2), megaeval gives the export (through transformers) the checkpoint's
numbers, and the export's logits are ours.  What a run without a corpus is told, and that
`run.toml` is the checkpoint's config, are checked from the same files.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from megacore import parallel_state as ps
from megatrain.checkpoint.files import find_checkpoint, read_meta
from megatrain.checkpoint.run_config import checkpoint_config
from megatrain.cli import main
from megatrain.config import load_config
from megatrain.testing import english_texts, world_of_one

SEQ, BATCH = 32, 4  # the run's sequence length and global batch (one microbatch a rank)


def _tokenizer(texts, path):
    """A byte-level BPE of 384 tokens trained on `texts`, with Llama's <unk> <s> </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return tok.get_vocab_size(with_added_tokens=True)


def _random_llama(root, vocab):
    """A random untied 4-layer Llama with grouped-query attention (2 groups: one a tp rank)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norms too: a misplaced tensor shows
    model.eval().save_pretrained(root)
    return model


def _invoke(command_main, *args):
    result = CliRunner().invoke(command_main, [str(a) for a in args])
    return result.exit_code, result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory):
    megadata_cli = pytest.importorskip("megadata.cli")
    megaeval_cli = pytest.importorskip("megaeval.cli")
    root = tmp_path_factory.mktemp("hf-to-run")
    texts = english_texts()
    hf_dir, ckpt, corpus, tuned = root / "hf", root / "ckpt", root / "corpus", root / "tuned"
    hf_dir.mkdir()
    vocab = _tokenizer(texts, hf_dir / "tokenizer.json")
    hf = _random_llama(hf_dir, vocab)
    out = {"hf": hf, "vocab": vocab, "root": root}

    # 1. import-hf: the checkpoint and run.toml.
    out["import"] = _invoke(main, "import-hf", hf_dir, "--out", ckpt)

    # 2. The corpus, from our own jsonl, with the model's tokenizer (the recipe run.toml shows).
    with open(root / "docs.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    tokenizer_lines = [
        line.removeprefix("#     ")
        for line in (ckpt / "run.toml").read_text().splitlines()
        if line.startswith("#     ")
    ]
    (root / "recipe.toml").write_text(
        f'name = "mine"\noutput = {json.dumps(str(corpus))}\n\n'
        f'[[sources]]\nname = "mine"\nkind = "jsonl"\n'
        f"paths = [{json.dumps(str(root / 'docs.jsonl'))}]\n\n"
        "[tokenizer]\n" + "\n".join(tokenizer_lines) + "\n\n[filter]\nmin_tokens = 32\n"
    )
    out["tokenizer_lines"] = tokenizer_lines
    out["megadata"] = _invoke(
        megadata_cli.main, "run", "--recipe", root / "recipe.toml", "--workers", 1,
        "--no-progress",
    )  # fmt: skip

    # 3. What a run without a corpus (or without any config) is told, before any worker.
    out["refused"] = {
        "load": _invoke(main, "run", "--load", ckpt),
        "run.toml": _invoke(main, "run", "--config", ckpt / "run.toml"),
        "neither": _invoke(main, "run"),
    }

    # 4. The run: the checkpoint's config, at tp 2, in workers of its own.
    run_dir = root / "run"
    command = [
        sys.executable, "-m", "megatrain.cli", "run", "--load", str(ckpt),
        f"data.corpus={str(corpus)!r}", "parallel.tensor_model_parallel_size=2",
        "--nproc-per-node", "2", "--save", str(tuned), "--master-port", str(_free_port()),
        f"training.seq_length={SEQ}", f"training.global_batch_size={BATCH}",
        "training.train_iters=2", "training.eval_interval=2", "training.eval_iters=1",
        "optimizer.lr=0.01", f"training.output_dir={str(run_dir)!r}",
        "logging.log_interval=1", "logging.tensorboard=false", "logging.peak_tflops=1.0",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out["run_stdout"] = result.stdout
    out["log"] = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    out["again"] = _invoke(main, "run", "--load", tuned)  # its own config: finished

    # 5. megaeval on the fine-tuned checkpoint; export-hf; megaeval on the export (transformers).
    (root / "eval.txt").write_text("\n".join(t.replace("\n", " ") for t in texts[-3:]) + "\n")
    scores = {}
    for name, model in (("ckpt", ["--ckpt", tuned]), ("export", ["--hf", root / "tuned-hf"])):
        if name == "export":
            out["export"] = _invoke(main, "export-hf", "--ckpt", tuned, "--out", root / "tuned-hf")
        code, said = _invoke(
            megaeval_cli.main, "wikitext103", *model, "--data", root / "eval.txt",
            "--seq-len", SEQ, "--stride", 16, "--json", root / f"{name}.json", "--no-progress",
        )  # fmt: skip
        assert code == 0, said
        scores[name] = json.loads((root / f"{name}.json").read_text())
    out["scores"] = scores
    return out


def test_import_hf_writes_the_run_config_beside_the_checkpoint(walkthrough):
    root = walkthrough["root"]
    code, said = walkthrough["import"]
    assert code == 0, said
    assert f"wrote {root / 'ckpt' / 'run.toml'}" in said and "set [data] corpus there" in said
    text = (root / "ckpt" / "run.toml").read_text()
    for section in ("[model]", "[parallel]", "[optimizer]", "[training]", "[data]"):
        assert f"\n{section}\n" in text, section
    assert '# corpus = "data/corpus/NAME"' in text  # the one field left to fill
    meta = read_meta(find_checkpoint(root / "ckpt"))
    # run.toml is the checkpoint's config: [model] field for field, and every other section.
    corpus = f"data.corpus={str(root / 'corpus')!r}"
    from_file = load_config(root / "ckpt" / "run.toml", [corpus]).to_dict()
    from_meta = checkpoint_config(root / "ckpt", [corpus]).to_dict()
    assert from_file["model"] == meta["config"]["model"]
    assert from_file["checkpoint"]["load"] == str((root / "ckpt").resolve())
    from_file["checkpoint"]["load"] = None
    for section in ("name", "checkpoint"):
        del from_file[section], from_meta[section]
    assert from_file == from_meta
    assert meta["config"]["training"]["seq_length"] == 64  # the model's positions, not 1024
    assert walkthrough["tokenizer_lines"][-2:] == [
        'eod_token = "</s>"   # ends each document',
        'bos_token = "<s>"   # starts each document',
    ]


def test_a_run_without_a_corpus_is_told_which_field_to_set(walkthrough):
    root = walkthrough["root"]
    ckpt, refused = root / "ckpt", walkthrough["refused"]
    for name in ("load", "run.toml"):
        code, said = refused[name]
        assert code == 2, said
        assert "holds a model imported from Hugging Face" in said
        assert "data.corpus=DIR" in said and str(ckpt / "iter_0000000" / "tokenizer.json") in said
    assert f"corpus in the [data] section of {ckpt / 'run.toml'}" in refused["run.toml"][1]
    code, said = refused["neither"]
    assert code == 2 and "give --config FILE" in said and "--load DIR" in said


def test_the_corpus_keeps_the_model_tokenizer(walkthrough):
    code, said = walkthrough["megadata"]
    assert code == 0, said
    root = walkthrough["root"]
    manifest = json.loads((root / "corpus" / "manifest.json").read_text())
    meta = read_meta(find_checkpoint(root / "ckpt"))
    assert manifest["tokenizer"]["sha256"] == meta["tokenizer"]["sha256"]
    assert manifest["tokenizer"]["eod_id"] == 2 and manifest["tokenizer"]["bos_id"] == 1


def test_the_run_starts_from_the_imported_weights_at_tp2(walkthrough):
    """Iteration 1's loss is the HF model's mean cross entropy on the run's first batch: the
    global samples 0..BATCH-1 of the corpus's training split, in the run's order."""
    from megatrain.data.corpus import open_corpus
    from megatrain.data.samples import GPTBatches

    root, hf = walkthrough["root"], walkthrough["hf"]
    assert "2 ranks = tp 2 x pp 1 x dp 1" in walkthrough["run_stdout"]
    assert [r["iteration"] for r in walkthrough["log"]] == [1, 2]
    batches = GPTBatches(open_corpus(root / "corpus", "train"), SEQ, 1234, BATCH, BATCH)
    samples = torch.from_numpy(np.stack([batches.sample(k) for k in range(BATCH)]))
    with torch.no_grad():
        logits = hf(samples[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), samples[:, 1:].flatten())
    first = walkthrough["log"][0]["loss"]
    assert abs(first - expected.item()) < 1e-4, (first, expected.item())
    assert walkthrough["log"][1]["loss"] != first  # and it trained
    meta = read_meta(find_checkpoint(root / "tuned"))
    assert meta["iteration"] == 2 and meta["config"]["data"]["corpus"] == str(root / "corpus")
    # --load of the fine-tuned checkpoint takes its own config (train_iters 2): nothing to do.
    code, said = walkthrough["again"]
    assert code == 0 and "already holds iteration 2 of training.train_iters=2" in said, said
    resumed = checkpoint_config(root / "tuned")
    assert resumed.checkpoint.save is None and resumed.data.verify_sha256
    assert resumed.parallel.tensor_model_parallel_size == 2


def test_megaeval_and_transformers_read_the_fine_tuned_model(walkthrough):
    import transformers

    from megatrain.inference.load import load_model

    root, vocab = walkthrough["root"], walkthrough["vocab"]
    code, said = walkthrough["export"]
    assert code == 0, said
    ckpt, export = walkthrough["scores"]["ckpt"], walkthrough["scores"]["export"]
    assert ckpt["model"]["iteration"] == 2 and ckpt["T"] == export["T"] > 100
    assert abs(ckpt["mean_loss"] - export["mean_loss"]) < 1e-5, (ckpt, export)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(root / "tuned-hf").eval()
    assert type(theirs).__name__ == "LlamaForCausalLM"
    tokens = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with world_of_one(root / "rendezvous"):
        ps.initialize_model_parallel(1, 1)
        ours = load_model(root / "tuned", torch.device("cpu")).chunks[0].eval()
        with torch.no_grad():
            our_logits = ours(tokens).transpose(0, 1)[..., :vocab]
    with torch.no_grad():
        their_logits = theirs(tokens).logits
        original = walkthrough["hf"](tokens).logits
    assert (our_logits - their_logits).abs().max() < 1e-4
    # The export holds the fine-tuned weights (lr 0.01, two steps), not the original's.
    assert (their_logits - original).abs().max() > 1e-3
