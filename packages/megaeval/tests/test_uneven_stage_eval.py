"""Evaluated at a pipeline size that does not divide the layers, a checkpoint gives the numbers
of one stage: the first stages take a layer more (`forward_pipeline_layout`), as DeepSeek-V3's
61 layers must split over any pp > 1.  A GPT-2 and the shipped deepseek-tiny (multi-latent
attention, experts, an MTP depth on the last stage), 4 layers each, at pp 3: 2, 1 and 1."""

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from eval_inputs import write_lambada, write_wikitext

from megacore import parallel_state as ps
from megacore.testing import run_distributed
from megaeval.checkpoint_scorer import CheckpointScorer
from megaeval.cli import main
from megaeval.lambada import evaluate_lambada
from megaeval.wikitext import evaluate_wikitext
from megatrain.checkpoint.files import CheckpointError, find_checkpoint, read_meta
from megatrain.config import load_config
from megatrain.inference.load import check_layout, load_model
from megatrain.run.loop import train
from megatrain.testing import grammar_texts, write_text_corpus

ROOT = Path(__file__).resolve().parents[3]
TRAIN = [
    "training.seq_length=32",
    "training.micro_batch_size=2",
    "training.global_batch_size=6",  # dp 3 over the spawn's 3 ranks
    "training.train_iters=4",
    "training.eval_interval=4",
    "training.eval_iters=1",
    "optimizer.lr=0.01",
    "optimizer.lr_warmup_iters=1",
    "logging.log_interval=4",
    "logging.tensorboard=false",
]
MODELS = {
    "gpt": (None, ["model.num_layers=4", "model.hidden_size=32", "model.num_attention_heads=4",
                   "model.max_position_embeddings=64", "model.make_vocab_size_divisible_by=64"]),
    "deepseek": (ROOT / "pipelines" / "models" / "deepseek-tiny.toml",
                 ["model.moe_grouped_gemm=false"]),
}  # fmt: skip
LAYOUTS = [(1, 1), (1, 3)]  # (tp, pp) on 3 ranks, the rest dp


def _train_and_evaluate(corpus: str, out: str, wiki: str, lambada: str) -> dict:
    results = {}
    for name, (config, overrides) in MODELS.items():
        ckpt = f"{out}/{name}"
        paths = [f"data.corpus={corpus!r}", f"training.output_dir={out + '/run-' + name!r}",
                 f"checkpoint.save={ckpt!r}"]  # fmt: skip
        train(load_config(config, [*TRAIN, *overrides, *paths]))
        for tp, pp in LAYOUTS:
            ps.initialize_model_parallel(tp, pp)
            loaded = load_model(ckpt, torch.device("cpu"))
            scorer = CheckpointScorer(loaded)
            seq = scorer.encode(" ".join(grammar_texts(2, seed=5)))[:60]
            results[name, pp] = {
                "layers": [list(c.layer_ids) for c in loaded.chunks],
                "mtp": [getattr(c, "mtp", None) is not None for c in loaded.chunks],
                "wikitext": evaluate_wikitext(
                    scorer, wiki, seq_len=24, stride=8, batch_size=3, progress=False
                ),
                "lambada": evaluate_lambada(
                    scorer, lambada, strict=True, batch_size=2, progress=False
                ),
                "hits": scorer.score([seq])[0].correct.nonzero()[0].tolist(),
            }
            ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    root = tmp_path_factory.mktemp("uneven-eval")
    corpus, _ = write_text_corpus(root / "corpus", grammar_texts(120, seed=1))
    wiki = write_wikitext(root / "wiki.test.tokens")
    lambada = write_lambada(root / "lambada.jsonl")
    ranks = run_distributed(
        _train_and_evaluate, 3, args=(str(corpus), str(root), str(wiki), str(lambada)), timeout=400
    )
    return root, wiki, ranks


@pytest.mark.parametrize("name", sorted(MODELS))
def test_three_stages_over_four_layers_give_the_one_stage_numbers(evaluated, name):
    _, _, ranks = evaluated
    one = ranks[0][name, 1]
    assert one["layers"] == [[0, 1, 2, 3]]
    # Each rank is one stage: 2, 1 and 1 layers, the MTP depth with the last.
    assert [r[name, 3]["layers"] for r in ranks] == [[[0, 1]], [[2]], [[3]]]
    if name == "deepseek":
        assert [r[name, 3]["mtp"] for r in ranks] == [[False], [False], [True]]
    wiki = one["wikitext"]
    assert wiki["windows"] > 3 and math.isfinite(wiki["adjusted_ppl"])
    for r in ranks:  # every rank returns the numbers, whatever its stage
        got = r[name, 3]
        for key in ("mean_loss", "adjusted_ppl"):
            assert got["wikitext"][key] == pytest.approx(wiki[key], rel=1e-5), key
        assert got["lambada"]["correct"] == one["lambada"]["correct"]
        assert got["lambada"]["target_loss"] == pytest.approx(
            one["lambada"]["target_loss"], rel=1e-5
        )
        assert got["hits"] == one["hits"]


def test_the_split_is_checked_before_any_worker_starts(evaluated):
    root, wiki, _ = evaluated
    for name, mtp in (("gpt", ""), ("deepseek", "m")):
        directory = find_checkpoint(root / name)
        meta = read_meta(directory)
        layout = check_layout(meta, 1, 3, directory).parallel.pipeline_model_parallel_layout
        assert layout == f"Et*2|t*1|t*1{mtp}L"
        assert check_layout(meta, 1, 4, directory).parallel.pipeline_model_parallel_layout is None
        fewer = r"--tp 1 --pp 5: the model has 4 transformer layers.*--pp 4 or fewer"
        with pytest.raises(CheckpointError, match=fewer):
            check_layout(meta, 1, 5, directory)
    args = ["wikitext103", "--ckpt", str(root / "gpt"), "--data", str(wiki), "--pp", "5"]
    result = CliRunner().invoke(main, [*args, "--seq-len", "24", "--stride", "8"])
    assert result.exit_code != 0 and "--pp 5" in result.output and "4 transformer" in result.output


def test_the_command_line_evaluates_at_three_stages(evaluated, tmp_path):
    """`megaeval wikitext103 --pp 3` (its own 3 workers) gives the in-process pp 1 numbers."""
    root, wiki, ranks = evaluated
    expected = ranks[0]["gpt", 1]["wikitext"]
    out = tmp_path / "wiki.json"
    args = ["wikitext103", "--ckpt", str(root / "gpt"), "--data", str(wiki), "--seq-len", "24",
            "--stride", "8", "--pp", "3", "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["model"]["pipeline_model_parallel_size"] == 3
    for key in ("mean_loss", "adjusted_ppl"):
        assert saved[key] == pytest.approx(expected[key], rel=1e-5), key
