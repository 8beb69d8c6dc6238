"""A megatrain checkpoint, GPT-2 or Llama, evaluated at several (tp, pp, cp) layouts gives the same
numbers, and its Hugging Face export (`--hf`) gives them too."""

import json
import math

import pytest
import torch
from click.testing import CliRunner
from eval_inputs import write_lambada, write_wikitext

from megacore import parallel_state as ps
from megacore.testing import run_distributed
from megaeval.checkpoint_scorer import CheckpointScorer, evaluate_checkpoint
from megaeval.cli import main
from megaeval.lambada import evaluate_lambada
from megaeval.wikitext import evaluate_wikitext
from megatrain.config import load_config
from megatrain.inference.load import load_model
from megatrain.run.loop import train
from megatrain.testing import grammar_texts, write_text_corpus

# (tp, pp, cp) on 4 ranks; the rest is dp.  cp: each sequence split over that many ranks.
LAYOUTS = [(2, 2, 1), (1, 2, 1), (2, 1, 1), (1, 1, 1), (1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2)]
# A Llama whose two key/value groups tp 2 splits, rotary positions, SwiGLU, untied output.
KINDS = {
    "gpt": [],
    "llama": ['model.kind="llama"', "model.num_query_groups=2", "training.train_iters=40"],
}


def _train_and_evaluate(corpus: str, out: str, wiki: str, lambada: str, kind: str) -> dict:
    ckpt = f"{out}/ckpt"
    overrides = [
        "model.num_layers=4",
        "model.hidden_size=32",
        "model.num_attention_heads=4",
        "model.max_position_embeddings=64",
        "model.make_vocab_size_divisible_by=64",
        "training.seq_length=32",
        "training.micro_batch_size=4",
        "training.global_batch_size=8",
        "training.train_iters=20",
        "training.eval_interval=20",
        "training.eval_iters=1",
        "optimizer.lr=0.01",
        "logging.log_interval=20",
        "logging.tensorboard=false",
        "logging.peak_tflops=1.0",
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2",
        f"data.corpus={corpus!r}",
        f"training.output_dir={out + '/run'!r}",
        f"checkpoint.save={ckpt!r}",
        *KINDS[kind],
    ]
    train(load_config(None, overrides))
    results = {"kind": kind}
    for tp, pp, cp in LAYOUTS:
        ps.initialize_model_parallel(tp, pp, context_parallel_size=cp)
        scorer = CheckpointScorer(load_model(ckpt, torch.device("cpu")))
        results[(tp, pp, cp)] = {
            "wikitext": evaluate_wikitext(
                scorer, wiki, seq_len=24, stride=8, batch_size=3, progress=False
            ),
            "lambada": evaluate_lambada(scorer, lambada, strict=True, batch_size=2, progress=False),
            # Brute force: each target of the file scored alone, with exactly the context
            # the sliding windows give it (see the test below).
            "tokens": scorer.encode(_detokenized(wiki)),
        }
        # Where the argmax over the whole (TP-split) vocabulary is right, on training-like text.
        seq = scorer.encode(" ".join(grammar_texts(2, seed=5)))[:60]
        results[(tp, pp, cp)]["hits"] = scorer.score([seq])[0].correct.nonzero()[0].tolist()
        if (tp, pp, cp) == (1, 1, 1):
            tokens = results[(tp, pp, cp)]["tokens"]
            results["brute"] = [
                float(scorer.score([tokens[max(0, _window_begin(t, 24, 8)) : t + 1]])[0].nll[-1])
                for t in range(1, len(tokens))
            ]
        ps.destroy_model_parallel()
    return results


def _detokenized(path: str) -> str:
    from megaeval.wikitext import detokenize, read_wikitext

    return detokenize(read_wikitext(path))


def _window_begin(target: int, seq_len: int, stride: int) -> int:
    """The first token of the window that scores `target` (written independently of
    megaeval.wikitext.windows: the first window scores targets 1..seq_len, the window starting
    at b > 0 scores targets b+seq_len-stride+1 .. b+seq_len)."""
    if target <= seq_len:
        return 0
    return math.ceil((target - seq_len) / stride) * stride


@pytest.fixture(scope="module", params=sorted(KINDS))
def evaluated(tmp_path_factory, request):
    root = tmp_path_factory.mktemp(f"ckpt-eval-{request.param}")
    corpus, _ = write_text_corpus(root / "corpus", grammar_texts(120, seed=1))
    wiki = write_wikitext(root / "wiki.test.tokens")
    lambada = write_lambada(root / "lambada.jsonl")
    args = (str(corpus), str(root), str(wiki), str(lambada), request.param)
    ranks = run_distributed(_train_and_evaluate, 4, args=args, timeout=300)
    return root, wiki, lambada, ranks


def test_every_layout_gives_the_same_numbers(evaluated):
    _, _, _, ranks = evaluated
    reference = ranks[0][(1, 1, 1)]
    wiki = reference["wikitext"]
    assert wiki["targets"] == wiki["T"] - 1 and wiki["windows"] > 3
    # A sanity bound on text unlike the training grammar's; the Llama, trained longer and with
    # an output layer of its own, is far more sure of the grammar (measured: ppl 9,723).
    bound = 1000 if ranks[0]["kind"] == "gpt" else 1e5
    assert 1.0 < wiki["ppl"] < bound and math.isfinite(wiki["adjusted_ppl"])
    for r in ranks:  # every rank returns the numbers, whatever its stage
        for layout in LAYOUTS:
            got = r[layout]
            for key in ("mean_loss", "adjusted_ppl"):
                assert got["wikitext"][key] == pytest.approx(wiki[key], rel=1e-5), (layout, key)
            assert got["lambada"]["correct"] == reference["lambada"]["correct"], layout
            assert got["lambada"]["target_loss"] == pytest.approx(
                reference["lambada"]["target_loss"], rel=1e-5
            )
            assert got["tokens"] == reference["tokens"]
            assert got["hits"] == reference["hits"], layout
    assert len(reference["hits"]) > 10  # the model learned the grammar a little


def test_sliding_windows_equal_brute_force(evaluated):
    _, _, _, ranks = evaluated
    reference, brute = ranks[0][(1, 1, 1)], ranks[0]["brute"]
    assert len(brute) == reference["wikitext"]["targets"]
    assert reference["wikitext"]["mean_loss"] == pytest.approx(sum(brute) / len(brute), rel=1e-6)


def test_command_line_at_another_layout(evaluated, tmp_path):
    root, wiki, lambada, ranks = evaluated
    expected = ranks[0][(1, 1, 1)]
    out = tmp_path / "wiki.json"
    args = ["wikitext103", "--ckpt", str(root / "ckpt"), "--data", str(wiki), "--seq-len", "24"]
    layout = ["--tp", "2", "--cp", "2"]
    result = CliRunner().invoke(main, [*args, "--stride", "8", *layout, "--json", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["mean_loss"] == pytest.approx(expected["wikitext"]["mean_loss"], rel=1e-5)
    assert saved["model"]["tensor_model_parallel_size"] == 2
    assert saved["model"]["context_parallel_size"] == 2
    # In this process (one worker), the same again through evaluate_checkpoint.
    direct = evaluate_checkpoint(
        "lambada", str(root / "ckpt"), data_path=str(lambada), strict=False, progress=False
    )
    assert direct["examples"] == 3 and direct["strict"] is False
    bad = CliRunner().invoke(main, [*args, "--stride", "8", "--tp", "3"])
    assert bad.exit_code != 0 and "--tp 3" in bad.output
    long = CliRunner().invoke(
        main, ["wikitext103", "--ckpt", str(root / "ckpt"), "--data", str(wiki)]
    )
    assert long.exit_code != 0 and "--seq-len" in long.output  # 1024 > the model's 64


def test_hugging_face_export_gives_the_same_numbers(evaluated, tmp_path):
    """The same model through transformers (`--hf`): the numbers other tools would report."""
    from megaeval.scoring import HFScorer
    from megatrain.hf import export_hf

    root, wiki, lambada, ranks = evaluated
    expected = ranks[0][(1, 1, 1)]
    export_hf(str(root / "ckpt"), str(tmp_path / "hf"))
    scorer = HFScorer(tmp_path / "hf")
    got = evaluate_wikitext(scorer, wiki, seq_len=24, stride=8, batch_size=3, progress=False)
    assert got["T"] == expected["wikitext"]["T"]
    assert got["mean_loss"] == pytest.approx(expected["wikitext"]["mean_loss"], rel=1e-5)
    got = evaluate_lambada(scorer, lambada, strict=True, batch_size=2, progress=False)
    assert got["correct"] == expected["lambada"]["correct"]
    assert got["target_loss"] == pytest.approx(expected["lambada"]["target_loss"], rel=1e-5)


def test_checkpoint_tokenizer_problems_name_the_file(evaluated, tmp_path):
    import shutil

    root, wiki, _, _ = evaluated
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "ckpt", ckpt)
    (iteration,) = ckpt.glob("iter_*")
    tokenizer = iteration / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace("endoftext", "endoftexu"))  # same size
    args = ["wikitext103", "--ckpt", str(ckpt), "--data", str(wiki), "--seq-len", "24"]
    result = CliRunner().invoke(main, [*args, "--stride", "8"])
    assert result.exit_code != 0 and "does not match the checkpoint" in result.output
    assert str(tokenizer) in result.output
    tokenizer.unlink()
    meta = json.loads((iteration / "meta.json").read_text())
    del meta["files"]["tokenizer.json"]  # as saved from a corpus without tokenizer.json
    (iteration / "meta.json").write_text(json.dumps(meta))
    result = CliRunner().invoke(main, [*args, "--stride", "8"])
    assert result.exit_code != 0 and "has no tokenizer" in result.output
