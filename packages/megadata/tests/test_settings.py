"""A recipe's settings: one loader for every section, which refuses a misspelt key (naming the
file, the section, the key and the nearest name) and a value of the wrong type, before any
stage runs; the defaults are those the stages had written inline."""

from dataclasses import asdict
from pathlib import Path

import pytest
from click.testing import CliRunner

from megadata.cli import main
from megadata.encode import DEFAULT_SPLITTER
from megadata.recipe import SECTIONS, STAGE_RUNS, STAGES, RecipeError, load_recipe
from megadata.settings import load
from megadata.sources.options import SourceOptions
from megadata.stages import clean, decontaminate, holdout
from megadata.stages.clean import CleanSettings
from megadata.stages.dedup import DedupSettings
from megadata.stages.filter import FilterSettings
from megadata.stages.shard import ShardSettings
from megadata.tokenizer import TokenizerSettings

PIPELINES = Path(__file__).parents[3] / "pipelines" / "corpus"
SHIPPED = sorted(PIPELINES.glob("*.toml"))
BASE = """\
name = "r"
output = "out"
partition_docs = 100

[[sources]]
name = "news"
kind = "text"
split = "line"
paths = ["news.txt"]

[dedup]
threshold = 0.7
num_perm = 128
"""


def _recipe(tmp_path: Path, text: str) -> Path:
    (tmp_path / "news.txt").write_text("A line of news.\n")
    path = tmp_path / "x.toml"
    path.write_text(text)
    return path


def _refusal(path: Path, command: str = "run") -> str:
    """What `megadata COMMAND --recipe PATH` says, having exited with status 2."""
    result = CliRunner().invoke(main, [command, "--recipe", str(path)])
    assert result.exit_code == 2, result.output
    assert not (path.parent / "out").exists()  # refused before any stage ran
    return result.output


@pytest.mark.parametrize("recipe", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_recipe_loads(recipe):
    loaded = load_recipe(recipe)
    assert loaded.filter.min_tokens == 128 and loaded.dedup.threshold == 0.7
    assert loaded.decontaminate is not None and loaded.decontaminate.fpr == 0.001


def test_a_misspelt_key_in_a_stage_section_exits_2_naming_file_section_key_and_nearest(
    tmp_path,
):
    path = _recipe(tmp_path, BASE.replace("threshold = 0.7", "treshold = 0.5"))
    said = _refusal(path)
    assert f"{path}: [dedup] has no key 'treshold'; did you mean 'threshold'?" in said


def test_a_misspelt_key_in_a_source_exits_2_naming_the_source(tmp_path):
    path = _recipe(tmp_path, BASE.replace('split = "line"', 'splt = "line"'))
    said = _refusal(path, "ingest")
    assert f"{path}: source 'news' has no key 'splt'; did you mean 'split'?" in said


def test_a_misspelt_key_at_the_top_level_exits_2(tmp_path):
    path = _recipe(tmp_path, BASE.replace("partition_docs = 100", "partition_doc = 100"))
    said = _refusal(path)
    assert f"{path}: the top level has no key 'partition_doc'; did you mean 'partition_docs'?" in (
        said
    )
    # A misspelt section is a misspelt key of the top level.
    path = _recipe(tmp_path, BASE.replace("[dedup]", "[dedupe]"))
    assert "the top level has no key 'dedupe'; did you mean 'dedup'?" in _refusal(path)


def test_a_key_like_no_field_is_named_without_a_guess(tmp_path):
    path = _recipe(tmp_path, BASE + "zzz = 1\n")
    said = _refusal(path)
    assert "[dedup] has no key 'zzz' (unknown field(s) ['zzz']" in said
    assert "did you mean" not in said


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("num_perm = 128", 'num_perm = "128"', "[dedup] num_perm must be a positive integer"),
        ("threshold = 0.7", "threshold = true", "[dedup] threshold must be a fraction in [0, 1]"),
        ("partition_docs = 100", 'partition_docs = "100"', "partition_docs must be a positive"),
        (
            "[dedup]",
            "[filter]\nmin_tokens = 1.5\n[dedup]",
            "[filter] min_tokens must be an integer",
        ),
        ("[dedup]", "[shard]\nsentence_boundaries = 1\n[dedup]", "must be true or false, got 1"),
        ("[dedup]", "[clean]\njoin_lines_sources = [1]\n[dedup]", "must be a list of strings"),
        ("[dedup]", "[holdout]\nsources = 'news'\n[dedup]", "must be a list of source names"),
        ("[dedup]", "[tokenizer]\nvocab = 5\n[dedup]", "[tokenizer] vocab must be a string"),
        ("partition_docs = 100", "partition_docs = 100\nfilter = 3", "filter must be a table"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_file_section_key_and_type(
    tmp_path, old, new, expected
):
    path = _recipe(tmp_path, BASE.replace(old, new))
    with pytest.raises(RecipeError) as refused:
        load_recipe(path)
    assert str(refused.value).startswith(f"recipe {path.absolute()}: ")
    assert expected in str(refused.value)
    assert expected in _refusal(path)


def test_an_integer_is_a_number_and_kept_as_written():
    assert load(DedupSettings, {"threshold": 1}, "[dedup]").threshold == 1
    assert isinstance(load(DedupSettings, {"threshold": 1}, "[dedup]").threshold, int)


def test_defaults_are_the_stages_former_inline_defaults(tmp_path):
    assert asdict(CleanSettings()) == {
        "detector": "langdetect",
        "min_english_prob": 0.9,
        "seed": 0,
        "join_lines_sources": [],
    }
    assert asdict(TokenizerSettings()) == {
        "kind": "gpt2-bpe",
        "vocab_size": None,  # trained to 8192 (DEFAULT_VOCAB_SIZE); a loaded one unchecked
        "lowercase": True,
        "train_mb": None,
        "vocab": None,
        "merges": None,
        "tokenizer_json": None,
        "eod_token": None,  # the kind's: <|endoftext|> or [SEP]
        "bos_token": None,
    }
    assert asdict(FilterSettings()) == {"min_tokens": 128}
    assert asdict(DedupSettings()) == {
        "threshold": 0.7,
        "num_perm": 128,
        "shingle_words": 2,
        "seed": 1,
    }
    assert asdict(holdout.settings({})) == {
        "every": 40,
        "sources": [],
        "lambada_per_doc": 10,
        "lambada_min_words": 60,
        "lambada_max_words": 120,
    }
    assert asdict(decontaminate.settings({})) == {
        "eval_sets": [],
        "ngram": 8,
        "fpr": 1e-3,
        "seed": 0,
        "article_overlap": 0.5,
        "copy_overlap": 0.8,
        "max_doc_overlap": None,
        "train_bloom": False,
        "bloom_shards": 8,
    }
    assert asdict(ShardSettings()) == {
        "valid_every": 30,
        "shard_tokens": 1 << 20,
        "sentence_boundaries": None,  # a BERT corpus's: tokenizer kind bert-wordpiece
    }
    assert asdict(SourceOptions()) == {"split": "file", "split_mb": 256, "max_doc_bytes": 16 << 20}
    recipe = load_recipe(_recipe(tmp_path, 'name = "r"\n[[sources]]\nname = "news"\nkind = "text"'
                                 '\npaths = ["news.txt"]\n'))  # fmt: skip
    assert (recipe.partition_docs, recipe.sentence_splitter) == (500, DEFAULT_SPLITTER)
    assert recipe.output == tmp_path / "corpus-r"
    assert recipe.holdout is None and recipe.decontaminate is None  # those stages link
    for name, settings in SECTIONS.items():
        if name not in ("holdout", "decontaminate"):
            assert getattr(recipe, name) == settings()
    assert recipe.tokenizer.kind == "gpt2-bpe" and recipe.dedup.num_perm == 128


def test_task_functions_take_a_section_as_a_dict_or_as_settings(tmp_path):
    from megadata.documents import write_docs

    write_docs(tmp_path / "in.arrow", [{"doc_id": "a", "source": "s", "text": "Some text."}])
    as_dict = clean.clean_partition(str(tmp_path / "in.arrow"), str(tmp_path / "a.arrow"), {})
    typed = CleanSettings()
    assert clean.clean_partition(str(tmp_path / "in.arrow"), str(tmp_path / "b.arrow"), typed) == (
        as_dict
    )
    with pytest.raises(RecipeError, match=r"\[clean\] has no key 'sed'; did you mean 'seed'\?"):
        clean.clean_partition(str(tmp_path / "in.arrow"), str(tmp_path / "c.arrow"), {"sed": 1})


def test_the_runner_is_a_table_of_the_stages_in_order():
    assert tuple(STAGE_RUNS) == STAGES and STAGES[0] == "ingest" and STAGES[-1] == "shard"


def test_a_copied_shipped_recipe_with_a_misspelt_key_is_refused_from_the_command_line(tmp_path):
    """The example of the issue: `treshold = 0.5` under [dedup] built at 0.7, silently."""
    pipelines = tmp_path / "pipelines" / "corpus"
    pipelines.mkdir(parents=True)
    text = (PIPELINES / "default.toml").read_text()
    assert "threshold = 0.7" in text
    (pipelines / "x.toml").write_text(text.replace("threshold = 0.7", "treshold = 0.5"))
    result = CliRunner().invoke(main, ["dedup", "--recipe", str(pipelines / "x.toml")])
    assert result.exit_code == 2
    assert (
        "pipelines/corpus/x.toml: [dedup] has no key 'treshold'; did you mean 'threshold'?"
        in result.output
    )
