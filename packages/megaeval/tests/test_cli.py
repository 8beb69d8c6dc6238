import json
import math
import os
import sys
import types

import pytest
from click.testing import CliRunner
from eval_inputs import LAMBADA, write_lambada, write_wikitext

from megaeval.cli import main
from megaeval.wikitext import count_raw_tokens, windows


def test_help_names_the_papers_evaluations():
    output = CliRunner().invoke(main, ["--help"]).output
    assert all(task in output for task in ("WikiText103", "LAMBADA", "fine-tuning"))
    assert "wikitext103" in output and "lambada" in output


def test_wikitext103_hf_end_to_end(tiny_gpt2, wikitext_file, tmp_path):
    out = tmp_path / "results" / "wikitext.json"
    args = ["wikitext103", "--hf", str(tiny_gpt2), "--data", str(wikitext_file)]
    args += ["--seq-len", "16", "--stride", "4", "--batch-size", "5", "--json", str(out)]
    result = CliRunner().invoke(main, [*args, "--no-progress"])
    assert result.exit_code == 0, result.output
    written = json.loads(out.read_text())
    raw = wikitext_file.read_text()
    assert written["T_o"] == count_raw_tokens(raw) and written["targets"] == written["T"] - 1
    assert written["windows"] == len(windows(written["T"], 16, 4))
    adjusted = math.exp(written["mean_loss"] * (written["T"] - 1) / (written["T_o"] - 1))
    assert written["adjusted_ppl"] == pytest.approx(adjusted, rel=1e-12)
    for shown in ("T_o", str(written["T"]), f"{written['mean_loss']:.4f}", "adjusted perplexity"):
        assert shown in result.output


def test_lambada_hf_end_to_end(tiny_gpt2, lambada_file, tmp_path):
    for strict, flag in ((True, "--strict"), (False, "--no-strict")):
        out = tmp_path / f"lambada-{flag}.json"
        args = ["lambada", "--hf", str(tiny_gpt2), "--data", str(lambada_file), flag]
        result = CliRunner().invoke(main, [*args, "--json", str(out), "--no-progress"])
        assert result.exit_code == 0, result.output
        written = json.loads(out.read_text())
        assert written["examples"] == len(LAMBADA) and written["strict"] is strict
        assert written["accuracy"] == written["correct"] / len(LAMBADA)
        if not strict:
            assert written["target_tokens"] == len(LAMBADA)
        assert "accuracy" in result.output and f"{written['target_ppl']:.3f}" in result.output


def test_seq_len_longer_than_the_model_is_refused(tiny_gpt2, wikitext_file):
    args = ["wikitext103", "--hf", str(tiny_gpt2), "--data", str(wikitext_file)]
    result = CliRunner().invoke(main, [*args, "--seq-len", "64", "--stride", "8"])
    assert result.exit_code != 0 and "--seq-len 64" in result.output


def test_stride_longer_than_seq_len_is_refused(tmp_path, wikitext_file):
    # Refused before any model is loaded: tmp_path holds no model at all.
    args = ["wikitext103", "--hf", str(tmp_path), "--data", str(wikitext_file)]
    result = CliRunner().invoke(main, [*args, "--seq-len", "8", "--stride", "9"])
    assert result.exit_code != 0 and "--stride" in result.output


WIKITEXT_BAD = {"missing": None, "empty": "", "blank": "  \n \n"}
LAMBADA_BAD = {
    "missing": None,
    "empty": "",
    "blank": "\n \n",
    "not json": '{"text": "one two"}\n{"text": \n',
    "no text": '{"passage": "one two"}\n',
    "empty text": '{"text": ""}\n',
    "one word": '{"text": "alone"}\n',
}


@pytest.mark.parametrize(
    ("command", "content"),
    [("wikitext103", c) for c in WIKITEXT_BAD.values()]
    + [("lambada", c) for c in LAMBADA_BAD.values()],
    ids=[f"wikitext-{k}" for k in WIKITEXT_BAD] + [f"lambada-{k}" for k in LAMBADA_BAD],
)
def test_bad_data_is_refused_naming_the_file_before_the_model_loads(tmp_path, command, content):
    data = tmp_path / "data.txt"
    if content is not None:
        data.write_text(content)
    not_a_model = tmp_path / "model"
    not_a_model.mkdir()
    result = CliRunner().invoke(main, [command, "--hf", str(not_a_model), "--data", str(data)])
    assert result.exit_code != 0
    assert str(data) in result.output and "--data" in result.output
    assert "config.json" not in result.output  # the data was checked first


def test_not_a_model_directory_is_refused(tmp_path, wikitext_file):
    result = CliRunner().invoke(
        main, ["wikitext103", "--hf", str(tmp_path), "--data", str(wikitext_file)]
    )
    assert result.exit_code != 0 and "config.json" in result.output


@pytest.mark.parametrize("command", ["wikitext103", "lambada"])
def test_exactly_one_of_ckpt_and_hf(tmp_path, command):
    data = write_lambada(tmp_path / "data.jsonl") if command == "lambada" else None
    data = data or write_wikitext(tmp_path / "data.txt")
    both = ["--ckpt", str(tmp_path), "--hf", str(tmp_path), "--data", str(data)]
    result = CliRunner().invoke(main, [command, *both])
    assert result.exit_code != 0 and "exactly one of --ckpt DIR or --hf DIR" in result.output
    result = CliRunner().invoke(main, [command, "--data", str(data)])
    assert result.exit_code != 0 and "exactly one of --ckpt DIR or --hf DIR" in result.output


def test_tp_with_hf_is_refused(tmp_path, wikitext_file):
    args = ["wikitext103", "--hf", str(tmp_path), "--data", str(wikitext_file)]
    for flag in ("--tp", "--cp"):
        result = CliRunner().invoke(main, [*args, flag, "2"])
        assert result.exit_code != 0 and "--tp/--pp/--cp apply to --ckpt only" in result.output


@pytest.mark.parametrize(
    ("command", "flags", "expected_kwargs"),
    [
        (
            "wikitext103",
            ["--seq-len", "512", "--stride", "64", "--batch-size", "4", "--tp", "2", "--cp", "2"],
            {"cp": 2, "seq_len": 512, "stride": 64, "batch_size": 4, "progress": True},
        ),
        (
            "lambada",
            ["--no-strict", "--pp", "2", "--no-progress"],
            {"cp": 1, "strict": False, "batch_size": 8, "progress": False},
        ),
    ],
)
def test_ckpt_hands_the_evaluate_arguments_to_the_checkpoint_scorer(
    tmp_path, monkeypatch, command, flags, expected_kwargs
):
    calls = []
    fake_results = {
        "wikitext103": dict(T_o=10, T=12, windows=1, seq_len=512, stride=64, mean_loss=2.5,
                            ppl=12.18, adjusted_ppl=15.5, targets=11),
        "lambada": dict(examples=3, strict=False, accuracy=2 / 3, correct=2, target_tokens=3,
                        target_ppl=4.25, target_loss=1.45),
    }  # fmt: skip

    def evaluate_checkpoint(task, ckpt, *, tp, pp, **kwargs):
        calls.append((task, ckpt, tp, pp, kwargs))
        return fake_results[task]

    fake_module = types.ModuleType("megaeval.checkpoint_scorer")
    fake_module.evaluate_checkpoint = evaluate_checkpoint
    monkeypatch.setitem(sys.modules, "megaeval.checkpoint_scorer", fake_module)

    data = write_lambada(tmp_path / "data.jsonl") if command == "lambada" else None
    data = data or write_wikitext(tmp_path / "data.txt")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    out = tmp_path / "out.json"
    args = [command, "--ckpt", str(ckpt), "--data", str(data), "--json", str(out), *flags]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    tp, pp = (2, 1) if command == "wikitext103" else (1, 2)
    assert calls == [(command, str(ckpt), tp, pp, {"data_path": str(data), **expected_kwargs})]
    assert json.loads(out.read_text()) == fake_results[command]
    assert ("15.500" if command == "wikitext103" else "66.67%") in result.output


def test_finetune_refuses_missing_task_files_and_a_non_bert_checkpoint(tmp_path):
    data, ckpt = tmp_path / "mnli", tmp_path / "ckpt"
    data.mkdir()
    ckpt.mkdir()
    result = CliRunner().invoke(
        main, ["finetune", "mnli", "--ckpt", str(ckpt), "--data", str(data)]
    )
    assert result.exit_code == 2, result.output
    assert "no train.tsv, dev_matched.tsv, dev_mismatched.tsv" in result.output
    for name in ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv"):
        (data / name).write_text("index\n")
    result = CliRunner().invoke(
        main, ["finetune", "mnli", "--ckpt", str(ckpt), "--data", str(data)]
    )
    assert result.exit_code == 2 and "--ckpt:" in result.output and "latest" in result.output


def _fake_checkpoint(ckpt, iteration: int) -> None:
    """A directory `find_checkpoint` accepts: `latest` naming an iteration with its meta.json."""
    directory = ckpt / f"iter_{iteration:07d}"
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"format_version": 1, "iteration": iteration, "files": {}}
    (directory / "meta.json").write_text(json.dumps(meta))
    (ckpt / "latest").write_text(directory.name)


def test_a_ckpt_evaluation_is_reused_until_checkpoint_data_or_settings_change(
    tmp_path, monkeypatch
):
    calls = []
    result = dict(examples=3, strict=True, accuracy=2 / 3, correct=2, target_tokens=3,
                  target_ppl=4.25, target_loss=1.45)  # fmt: skip

    def evaluate_checkpoint(task, ckpt, **kwargs):
        calls.append(task)
        return result

    fake_module = types.ModuleType("megaeval.checkpoint_scorer")
    fake_module.evaluate_checkpoint = evaluate_checkpoint
    monkeypatch.setitem(sys.modules, "megaeval.checkpoint_scorer", fake_module)
    ckpt, out = tmp_path / "ckpt", tmp_path / "lambada.json"
    _fake_checkpoint(ckpt, 10)
    data = write_lambada(tmp_path / "data.jsonl")

    def run(*flags):
        args = ["lambada", "--ckpt", str(ckpt), "--data", str(data), "--json", str(out), *flags]
        outcome = CliRunner().invoke(main, args)
        assert outcome.exit_code == 0, outcome.output
        assert "66.67%" in outcome.output  # the table, evaluated or reused
        return outcome.output

    run()
    assert len(calls) == 1 and json.loads(out.read_text())["cache_key"]["iteration"] == 10
    second = run()
    assert len(calls) == 1 and "megaeval lambada: reused" in second and "iteration 10" in second
    run("--force")
    assert len(calls) == 2
    run("--no-strict")  # other settings: evaluated, and cached under them
    assert len(calls) == 3
    _fake_checkpoint(ckpt, 20)  # trained on
    run("--no-strict")
    assert len(calls) == 4
    write_lambada(data, ["another passage ending in a word"])  # the file changed
    run("--no-strict")
    assert len(calls) == 5
    run("--no-strict")
    assert len(calls) == 5


def test_an_eval_file_that_vanishes_after_the_check_is_named(tiny_gpt2, tmp_path, monkeypatch):
    """The file passes the up-front check, then disappears before the model reads it (deleted,
    an unmounted share): one line naming it, exit status 2, no traceback."""
    from megaeval import cli

    data = write_lambada(tmp_path / "lambada.jsonl")
    checked = cli.check_data

    def check_then_vanish(read, path):
        checked(read, path)
        os.remove(path)

    monkeypatch.setattr(cli, "check_data", check_then_vanish)
    args = ["lambada", "--hf", str(tiny_gpt2), "--data", str(data), "--no-progress"]
    result = CliRunner().invoke(main, args, prog_name="megaeval")
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"megaeval lambada: {data}: no such file"  # nothing drawn


def test_finetune_settings_are_checked_against_the_checkpoint_naming_flags():
    """What `megaeval finetune` checks before any worker starts speaks of its own flags."""
    from megaeval.finetune.engine import Settings, plan
    from megatrain.config import load_config

    overrides = ['model.kind="bert"', "model.num_layers=2", "model.hidden_size=32",
                 "model.num_attention_heads=4", "model.max_position_embeddings=128"]  # fmt: skip
    meta = {"config": load_config(None, overrides).to_dict(), "vocab_size": 1000}
    assert plan("mnli", meta, Settings(batch_size=8, micro_batch_size=2), 2)[1][0] == 8
    assert plan("mnli", meta, Settings(), 1) == ("336m", (128, 1e-5, 10))  # Table 6
    refused = [
        ("mnli", Settings(batch_size=6), 1, r"--batch-size 6 is not a multiple of "
         r"--micro-batch-size 4 x --dp 1"),
        ("qqp", Settings(micro_batch_size=3), 2, r"--batch-size 128 \(Table 6's for 336m\) is "
         r"not a multiple of --micro-batch-size 3 x --dp 2"),
        ("squad1", Settings(), 1, r"--max-seq-length 384 \(the squad1 default\) is above the "
         r"checkpoint's 128 positions .*: pass --max-seq-length 128 or less"),
        ("race", Settings(max_seq_length=256), 1, r"--max-seq-length 256 is above"),
        ("mnli", Settings(tp=3), 1, r"the checkpoint's model.num_attention_heads \(4\) is not "
         r"divisible by --tp \(3\)"),
        ("mnli", Settings(pp=4, batch_size=16), 1, r"the checkpoint's model.num_layers \(2\) "
         r"is not divisible by --pp"),
    ]  # fmt: skip
    for task, settings, dp, message in refused:
        with pytest.raises(ValueError, match=message):
            plan(task, meta, settings, dp)


@pytest.mark.parametrize("command", ["wikitext103", "lambada"])
def test_a_checkpoint_of_a_newer_megatrain_is_refused_in_one_line(tmp_path, command):
    from megatrain.testing import write_newer_checkpoint

    data = tmp_path / "data"
    (write_wikitext if command == "wikitext103" else write_lambada)(data)
    ckpt = write_newer_checkpoint(tmp_path / "ckpt", "parallel.new_parallelism", "9.0.0")
    args = [command, "--ckpt", str(ckpt), "--data", str(data)]
    result = CliRunner().invoke(main, args, prog_name="megaeval")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    (line,) = result.output.strip().splitlines()
    assert "parallel.new_parallelism" in line and "megatrain 9.0.0" in line, line
