"""Generation: the KV cache and tp change nothing; the top-k and top-p filters are right."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from megacore import parallel_state as ps
from megacore.testing import run_distributed
from megatrain.checkpoint.files import CheckpointError, find_checkpoint, read_meta
from megatrain.cli import main
from megatrain.config import load_config
from megatrain.inference.generate import Sampling, filter_logits, generate
from megatrain.inference.load import check_layout, load_model
from megatrain.run.loop import train
from megatrain.testing import grammar_texts, write_newer_checkpoint, write_text_corpus

PROMPT = "the cat sat on"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root, _ = write_text_corpus(tmp_path_factory.mktemp("text-corpus"), grammar_texts(120))
    return str(root)


def _config(corpus, out, ckpt, overrides=()):
    return load_config(
        None,
        [
            "model.num_layers=2",
            "model.hidden_size=32",
            "model.num_attention_heads=4",
            "model.max_position_embeddings=64",
            "model.make_vocab_size_divisible_by=64",
            "training.seq_length=32",
            "training.micro_batch_size=4",
            "training.global_batch_size=8",
            "training.train_iters=40",
            "training.eval_interval=40",
            "training.eval_iters=1",
            "optimizer.lr=0.01",
            "optimizer.lr_warmup_iters=4",
            "logging.log_interval=20",
            "logging.tensorboard=false",
            "logging.peak_tflops=1.0",
            "parallel.tensor_model_parallel_size=2",
            f"data.corpus={corpus!r}",
            f"training.output_dir={out!r}",
            f"checkpoint.save={ckpt!r}",
            *overrides,
        ],
    )


# A Llama whose MLPs are 4 experts, 2 a token, trained with them over 2 expert-parallel ranks.
MOE = ['model.kind="llama"', "model.num_moe_experts=4", "model.moe_router_topk=2",
       "parallel.tensor_model_parallel_size=1", "parallel.expert_model_parallel_size=2",
       "training.train_iters=8", "training.eval_interval=8"]  # fmt: skip


def _generations(ckpt: str) -> dict:
    """Greedy with and without the cache, sampling twice with one seed, and logits per step."""
    loaded = load_model(ckpt, torch.device("cpu"))
    model, tok = loaded.chunks[0], loaded.tokenizer
    prompt = tok.encode(PROMPT).ids
    greedy = Sampling(max_new_tokens=12, greedy=True, stop_at_eod=False)
    sampled = Sampling(max_new_tokens=12, top_k=5, top_p=0.9, temperature=0.8, seed=7)
    out = {
        "greedy_cache": generate(model, prompt, greedy, loaded.eod_id, use_cache=True),
        "greedy_full": generate(model, prompt, greedy, loaded.eod_id, use_cache=False),
        "sampled": [generate(model, prompt, sampled, loaded.eod_id) for _ in range(2)],
        "sampled_no_cache": generate(model, prompt, sampled, loaded.eod_id, use_cache=False),
    }
    out["text"] = tok.decode(out["greedy_cache"])
    # Logits of a prompt fed in pieces through the cache against one full forward.
    from megatrain.models.attention.kv_cache import KVCache

    ids = torch.tensor([prompt + out["greedy_cache"][:6]])
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(max_length=ids.shape[1])
        pieces = [model(ids[:, :3], cache=cache), model(ids[:, 3:7], cache=cache)]
        pieces += [model(ids[:, i : i + 1], cache=cache) for i in range(7, ids.shape[1])]
    finite = torch.isfinite(full)
    stepped = torch.cat(pieces)
    out["cache_max_diff"] = float((full[finite] - stepped[finite]).abs().max())
    return out


def _train_then_generate(corpus, out):
    ckpt = f"{out}/ckpt"
    history = train(_config(corpus, f"{out}/run", ckpt))
    results = {"history": history}
    for tp in (2, 1):  # tp=1 on two ranks is dp=2: each rank holds the whole model
        ps.initialize_model_parallel(tp, 1)
        results[f"tp{tp}"] = _generations(ckpt)
        ps.destroy_model_parallel()
    # Experts trained at ep 2 read at tp 2 (split over TP as expert tensor parallelism, the
    # TP ranks' shared tokens dispatched without sequence parallelism) and whole at tp 1.
    moe = f"{out}/moe-ckpt"
    train(_config(corpus, f"{out}/moe-run", moe, MOE))
    check_layout(read_meta(find_checkpoint(moe)), 2, 1, Path(moe))
    for tp in (2, 1):
        ps.initialize_model_parallel(tp, 1)
        results[f"moe-tp{tp}"] = _generations(moe)
        ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def generated(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("generate")
    ranks = run_distributed(_train_then_generate, 2, args=(corpus, str(out)), timeout=300)
    return out, ranks


def test_kv_cache_and_tp_do_not_change_generation(generated):
    _, ranks = generated
    first = ranks[0]
    assert first["history"]["loss"][-1] < first["history"]["loss"][0] - 1.0  # it learned
    for r in ranks:
        for tp in ("tp2", "tp1"):
            g = r[tp]
            assert g["greedy_cache"] == g["greedy_full"], tp
            assert g["cache_max_diff"] < 1e-5, tp
            # One seed, one sample; the cache does not change the random stream either.
            assert g["sampled"][0] == g["sampled"][1] == g["sampled_no_cache"], tp
            assert len(g["greedy_cache"]) == 12
    # Every rank and every layout: the same tokens.
    for key in ("greedy_cache", "sampled"):
        values = [r[tp][key] for r in ranks for tp in ("tp2", "tp1")]
        assert all(v == values[0] for v in values), key
    # The tiny grammar: after "the cat sat on" a trained model says " the".
    assert first["tp2"]["text"].startswith(" the"), first["tp2"]["text"]
    # The mixture of experts: the same tokens at tp 2 and tp 1, with and without the cache.
    moe = [r[f"moe-{tp}"] for r in ranks for tp in ("tp2", "tp1")]
    for g in moe:
        assert g["greedy_cache"] == g["greedy_full"] == moe[0]["greedy_cache"]
        assert g["cache_max_diff"] < 1e-5


def test_generate_command_at_tp2_and_tp1(generated):
    out, ranks = generated
    runner = CliRunner()
    expected = PROMPT + ranks[0]["tp2"]["text"]
    for tp in ("2", "1"):
        args = ["generate", "--ckpt", str(out / "ckpt"), "--prompt", PROMPT, "--greedy"]
        result = runner.invoke(main, [*args, "--max-new-tokens", "12", "--keep-going", "--tp", tp])
        assert result.exit_code == 0, result.output
        assert expected in result.output, (tp, result.output)
    bad = runner.invoke(
        main, ["generate", "--ckpt", str(out / "ckpt"), "--prompt", "x", "--tp", "3"]
    )
    assert bad.exit_code != 0 and "--tp 3" in bad.output and "num_attention_heads" in bad.output
    missing = runner.invoke(main, ["generate", "--ckpt", str(out / "nothing"), "--prompt", "x"])
    assert missing.exit_code != 0 and re.search(r"nothing/latest does not exist", missing.output)


def test_checkpoint_tokenizer_is_checked(generated, tmp_path):
    import shutil

    out, _ = generated
    ckpt = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt", ckpt)
    (iteration,) = ckpt.glob("iter_*")
    runner = CliRunner()
    tokenizer = iteration / "tokenizer.json"
    # Another tokenizer of the same size (the size check would catch any other).
    tokenizer.write_text(tokenizer.read_text().replace("endoftext", "endoftexu"))
    result = runner.invoke(main, ["generate", "--ckpt", str(ckpt), "--prompt", "the"])
    assert result.exit_code != 0 and "does not match the checkpoint" in result.output
    assert str(tokenizer) in result.output
    # A checkpoint saved from a corpus without tokenizer.json.
    tokenizer.unlink()
    meta = json.loads((iteration / "meta.json").read_text())
    del meta["files"]["tokenizer.json"]
    (iteration / "meta.json").write_text(json.dumps(meta))
    result = runner.invoke(main, ["generate", "--ckpt", str(ckpt), "--prompt", "the"])
    assert result.exit_code != 0 and "has no tokenizer" in result.output


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    kept = lambda x: torch.isfinite(x).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [0, 1]
    assert kept(filter_logits(logits, top_p=0.45)) == [0]  # reached by the first alone
    assert kept(filter_logits(logits, top_p=0.6)) == [0, 1]
    assert kept(filter_logits(logits, top_p=0.86)) == [0, 1, 2, 3]
    assert kept(filter_logits(logits, top_k=3, top_p=0.99)) == [0, 1, 2]
    shuffled = logits[torch.tensor([3, 0, 4, 2, 1])]  # the filter follows values, not positions
    assert kept(filter_logits(shuffled, top_p=0.75)) == [1, 3, 4]
    # Sampling from the filtered distribution: frequencies follow the renormalised probabilities.
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(filter_logits(logits, top_k=2), -1)
    draws = torch.multinomial(probs, 20000, replacement=True, generator=gen)
    assert math.isclose(float((draws == 0).float().mean()), 0.5 / 0.7, abs_tol=0.015)
    with pytest.raises(ValueError, match="--top-p"):
        Sampling(top_p=0)
    with pytest.raises(ValueError, match="--temperature"):
        Sampling(temperature=0)


def test_a_checkpoint_of_a_newer_megatrain_is_refused_in_one_line(tmp_path):
    # Its run config holds a field this megatrain lacks: one line naming the field and the
    # version that wrote it, where building the config ended in a TypeError traceback.
    for version, by in (("9.0.0", "megatrain 9.0.0"), (None, "did not record its version")):
        ckpt = write_newer_checkpoint(tmp_path / f"ckpt-{version}", "model.sink_size", version)
        result = CliRunner().invoke(main, ["generate", "--ckpt", str(ckpt), "--prompt", "the"])
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
        (line,) = result.output.strip().splitlines()
        assert "model.sink_size" in line and by in line and "meta.json" in line, line
        # The loader refuses it the same way (megaeval and the other readers go through it).
        with pytest.raises(CheckpointError, match=r"holds model\.sink_size, which this"):
            load_model(ckpt, torch.device("cpu"))
