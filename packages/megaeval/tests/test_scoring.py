import shutil

import numpy as np
import pytest
from eval_inputs import WIKITEXT

from megaeval.errors import EvalDataError
from megaeval.scoring import HFScorer


def test_a_batch_scores_as_its_sequences_alone(tiny_gpt2):
    scorer = HFScorer(tiny_gpt2, dtype="float64")
    tokens = scorer.encode(WIKITEXT)
    seqs = [tokens[:33], tokens[40:45], tokens[100:102]]  # 32 inputs, 4, 1: right padding
    batched = scorer.score(seqs)
    for seq, together in zip(seqs, batched, strict=True):
        (alone,) = scorer.score([seq])
        assert together.nll.dtype == np.float64 and together.correct.dtype == bool
        assert len(together.nll) == len(together.correct) == len(seq) - 1
        np.testing.assert_allclose(together.nll, alone.nll, rtol=1e-12)
        np.testing.assert_array_equal(together.correct, alone.correct)
    # nll is a negative log probability of a 400-token vocabulary: positive, near log(400).
    assert all(r.nll.min() > 0 and r.nll.max() < 3 * np.log(400) for r in batched)


def test_half_precision_scores_near_float32(tiny_gpt2):
    seq = HFScorer(tiny_gpt2).encode(WIKITEXT)[:20]
    (full,) = HFScorer(tiny_gpt2).score([seq])
    (half,) = HFScorer(tiny_gpt2, dtype="bfloat16").score([seq])
    assert half.nll.dtype == np.float64
    np.testing.assert_allclose(half.nll, full.nll, rtol=0.02)


def test_sequences_longer_than_the_model_are_refused(tiny_gpt2):
    scorer = HFScorer(tiny_gpt2)
    with pytest.raises(ValueError, match="2 to 33 tokens"):
        scorer.score([list(range(34))])
    assert len(scorer.score([list(range(33))])[0].nll) == 32


def test_without_tokenizer_json_the_auto_tokenizer_reads_the_directory(tiny_gpt2, tmp_path):
    from tokenizers import Tokenizer

    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_gpt2 / name, tmp_path / name)
    Tokenizer.from_file(str(tiny_gpt2 / "tokenizer.json")).model.save(str(tmp_path))
    assert not (tmp_path / "tokenizer.json").exists()
    assert HFScorer(tmp_path).encode(WIKITEXT) == HFScorer(tiny_gpt2).encode(WIKITEXT)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(EvalDataError, match=f"{tmp_path}: not a Hugging Face model directory"):
        HFScorer(tmp_path)
