"""The fine-tuning readers on small files in the official formats, bad rows included."""

import json
from pathlib import Path

import pytest

from megaeval.errors import EvalDataError
from megaeval.finetune.readers import (
    MNLI_LABELS,
    PairExample,
    RaceExample,
    SquadAnswer,
    read_mnli,
    read_mnli_file,
    read_qqp,
    read_race,
    read_squad,
)

MNLI_COMMON = [
    "index",
    "promptID",
    "pairID",
    "genre",
    "sentence1_binary_parse",
    "sentence2_binary_parse",
    "sentence1_parse",
    "sentence2_parse",
    "sentence1",
    "sentence2",
]
MNLI_TRAIN_HEADER = [*MNLI_COMMON, "label1", "gold_label"]
MNLI_DEV_HEADER = [*MNLI_COMMON, "label1", "label2", "label3", "label4", "label5", "gold_label"]


def mnli_row(index, s1, s2, *labels, genre="fiction"):
    parses = [f"( {s1} )", f"( {s2} )", f"(ROOT {s1})", f"(ROOT {s2})"]
    return [str(index), "31193", f"{index}n", genre, *parses, s1, s2, *labels]


def write_tsv(path, rows, newline="\n"):
    path.write_text(newline.join("\t".join(row) for row in rows) + newline, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- MNLI


@pytest.fixture
def mnli_dir(tmp_path):
    d = tmp_path / "MNLI"
    d.mkdir()
    write_tsv(
        d / "train.tsv",
        [
            MNLI_TRAIN_HEADER,
            mnli_row(0, "A man walks.", "A person moves.", "entailment", "entailment"),
            # A stray double quote: with csv's default quoting it would swallow the next rows.
            mnli_row(1, 'He said "hello to her.', "He spoke.", "neutral", "neutral"),
            mnli_row(2, "It rains.", "It is dry.", "contradiction", "contradiction"),
            mnli_row(3, "Short row.", "One label column only", "neutral"),  # 11 columns
            mnli_row(4, "Who knows.", "Nobody.", "neutral", "-"),  # unknown gold label
            mnli_row(5, "The end.", "It ended.", "entailment", "entailment", genre="slate"),
        ],
    )
    write_tsv(
        d / "dev_matched.tsv",
        [
            MNLI_DEV_HEADER,
            # label1 says neutral but the gold label (majority) is entailment.
            mnli_row(7, "Dogs bark.", "Animals make noise.", *["neutral"] + ["entailment"] * 5),
        ],
    )
    write_tsv(d / "test_matched.tsv", [MNLI_COMMON, mnli_row(9, "Cats nap.", "Cats sleep.")])
    return d


def test_mnli_train_counts_and_problems(mnli_dir):
    examples, problems = read_mnli(mnli_dir, "train")
    assert [e.uid for e in examples] == ["0", "1", "2", "5"]
    assert examples[1] == PairExample(
        uid="1",
        text_a='He said "hello to her.',
        text_b="He spoke.",
        label=MNLI_LABELS["neutral"],
        line=3,
        genre="fiction",
    )
    assert [e.label for e in examples] == [1, 2, 0, 1]
    assert examples[3].genre == "slate"
    assert len(problems) == 2
    short, unknown = problems
    assert short.path.endswith("train.tsv") and short.where == "line 5"
    assert "11 column(s), expected 12" in short.message
    assert unknown.where == "line 6" and "unknown gold_label '-'" in unknown.message
    assert str(unknown).startswith(str(mnli_dir / "train.tsv") + ", line 6: ")


def test_mnli_labels_are_megatrons_order():
    assert MNLI_LABELS == {"contradiction": 0, "entailment": 1, "neutral": 2}


def test_mnli_dev_uses_gold_label_and_test_has_none(mnli_dir):
    dev = read_mnli(mnli_dir, "dev_matched", strict=True)
    assert len(dev) == 1 and dev.examples[0].label == MNLI_LABELS["entailment"]
    test = read_mnli(mnli_dir, "test_matched", strict=True)
    assert test.problems == [] and test.examples[0].label is None
    assert test.examples[0].text_b == "Cats sleep."


def test_mnli_strict_lists_the_problems(mnli_dir):
    with pytest.raises(ValueError, match=r"2 problem\(s\) reading .*train\.tsv") as info:
        read_mnli(mnli_dir, "train", strict=True)
    assert "line 5: 11 column(s)" in str(info.value)
    assert "line 6: unknown gold_label" in str(info.value)


def test_mnli_missing_directory_and_file(tmp_path, mnli_dir):
    with pytest.raises(
        FileNotFoundError, match=r"expected the GLUE MNLI directory with train\.tsv"
    ):
        read_mnli(tmp_path / "nowhere", "train")
    with pytest.raises(FileNotFoundError, match=r"dev_mismatched\.tsv: no such file"):
        read_mnli(mnli_dir, "dev_mismatched")
    with pytest.raises(ValueError, match="unknown MNLI split 'dev'"):
        read_mnli(mnli_dir, "dev")


def test_mnli_header_without_needed_column(tmp_path):
    path = write_tsv(tmp_path / "train.tsv", [MNLI_COMMON[:-1], ["0"] * 9])
    with pytest.raises(EvalDataError, match="no column 'sentence2', 'gold_label'"):
        read_mnli_file(path)
    (tmp_path / "empty.tsv").write_text("")
    with pytest.raises(EvalDataError, match="empty file"):
        read_mnli_file(tmp_path / "empty.tsv")


def test_mnli_crlf_and_blank_line(tmp_path):
    path = write_tsv(
        tmp_path / "dev.tsv",
        [
            MNLI_TRAIN_HEADER,
            mnli_row(0, "A.", "B.", "neutral", "neutral"),
            [""],
            mnli_row(1, "C.", "D.", "neutral", "contradiction"),
        ],
        newline="\r\n",
    )
    examples, problems = read_mnli_file(path)
    assert [(e.uid, e.label, e.text_b) for e in examples] == [("0", 2, "B."), ("1", 0, "D.")]
    assert [(p.where, p.message) for p in problems] == [("line 3", "blank line")]


# ----------------------------------------------------------------------------- QQP


def test_qqp_splits_by_header_name(tmp_path):
    d = tmp_path / "QQP"
    d.mkdir()
    write_tsv(
        d / "train.tsv",
        [
            ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
            ["10", "1", "2", "How do I cook rice?", "How to cook rice?", "1"],
            ["11", "3", "4", 'What is "love?', "Why is the sky blue?", "0"],
            ["12", "5", "6", "Is this a question?", "", "0"],  # empty question2
            ["13", "7", "8", "Why?", "Why not?", "2"],  # unknown label
            ["10", "9", "10", "Same id again?", "Yes.", "0"],  # duplicate id
            ["14", "11", "12", "Too", "many", "columns", "1"],
        ],
    )
    # Columns in another order: found by name, not position.
    write_tsv(
        d / "dev.tsv",
        [
            ["is_duplicate", "question2", "question1", "qid2", "qid1", "id"],
            ["1", "Second?", "First?", "2", "1", "20"],
        ],
    )
    write_tsv(d / "test.tsv", [["id", "question1", "question2"], ["0", "Q one?", "Q two?"]])

    examples, problems = read_qqp(d, "train")
    assert [(e.uid, e.label) for e in examples] == [("10", 1), ("11", 0)]
    assert examples[1].text_a == 'What is "love?' and examples[0].genre is None
    assert [p.where for p in problems] == ["line 4", "line 5", "line 6", "line 7"]
    assert "empty question2" in problems[0].message
    assert "unknown is_duplicate '2'" in problems[1].message
    assert "duplicate id '10'" in problems[2].message
    assert "7 column(s), expected 6" in problems[3].message

    (dev,), _ = read_qqp(d, "dev", strict=True)
    assert (dev.uid, dev.text_a, dev.text_b, dev.label) == ("20", "First?", "Second?", 1)
    (test,), _ = read_qqp(d, "test", strict=True)
    assert test.label is None and test.text_b == "Q two?"
    with pytest.raises(FileNotFoundError, match="expected the GLUE QQP directory"):
        read_qqp(tmp_path / "missing", "dev")


def test_strict_error_shows_the_first_five_and_a_count(tmp_path):
    header = ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"]
    rows = [header] + [[str(i), "1", "2", "a?", "b?", "yes"] for i in range(8)]
    write_tsv(tmp_path / "train.tsv", rows)
    with pytest.raises(ValueError, match=r"8 problem\(s\)") as info:
        read_qqp(tmp_path, "train", strict=True)
    message = str(info.value)
    assert "line 6:" in message and "line 7:" not in message and "... and 3 more" in message


# ----------------------------------------------------------------------------- SQuAD

CONTEXT = "The cat sat on the mat. Later the dog sat too."


def squad_file(path, qas, version="1.1", context=CONTEXT):
    data = {
        "version": version,
        "data": [{"title": "Pets", "paragraphs": [{"context": context, "qas": qas}]}],
    }
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def qa(qid, answers, question="Q?", **extra):
    answers = [{"text": t, "answer_start": s} for t, s in answers]
    return {"id": qid, "question": question, "answers": answers, **extra}


def test_squad_v11_reads_and_checks_answer_offsets(tmp_path):
    assert CONTEXT.index("sat") == 8 and CONTEXT.rindex("sat") == 38
    path = squad_file(
        tmp_path / "dev-v1.1.json",
        [
            qa("q1", [("cat", 4)], question="Who sat?"),
            qa("q2", [("the mat", 15), ("mat", 19), ("the mat.", 15)]),  # dev: several answers
            qa("q3", [("sat", 35)]),  # wrong offset: nearest "sat" is at 38
            qa("q4", [("horse", 0)]),  # nowhere in the context
            {"id": "q5", "answers": [{"text": "cat", "answer_start": 4}]},  # no question
            qa("q1", [("cat", 4)]),  # duplicate id
        ],
    )
    examples, problems = read_squad(path)
    assert [e.id for e in examples] == ["q1", "q2", "q3"]
    q1, q2, q3 = examples
    assert (q1.question, q1.context, q1.title, q1.is_impossible) == (
        "Who sat?",
        CONTEXT,
        "Pets",
        False,
    )
    assert q2.answers == (
        SquadAnswer("the mat", 15),
        SquadAnswer("mat", 19),
        SquadAnswer("the mat.", 15),
    )
    assert q3.answers == (SquadAnswer("sat", 38),)
    assert [(p.where, p.message) for p in problems] == [
        (
            "question q3",
            "answer 0 'sat' is not at answer_start 35; found nearest at 38 and moved there",
        ),
        (
            "question q4",
            "answer 0 'horse' is not at answer_start 0 (not found in the context); skipped",
        ),
        ("question q4", "no usable answer; skipped"),
        ("question q5", 'no string "question"; skipped'),
        ("question q1", "duplicate question id; skipped"),
    ]
    assert all(p.path == str(path) for p in problems)


def test_squad_fix_offsets_off_skips_the_mismatch(tmp_path):
    path = squad_file(tmp_path / "train.json", [qa("a", [("sat", 35)]), qa("b", [("dog", 34)])])
    examples, problems = read_squad(path, fix_offsets=False)
    assert [e.id for e in examples] == ["b"]
    assert "(fix_offsets is off); skipped" in problems[0].message
    with pytest.raises(ValueError, match=r"(?s)2 problem\(s\).*question a: answer 0"):
        read_squad(path, fix_offsets=False, strict=True)


def test_squad_v20_impossible_questions(tmp_path):
    path = squad_file(
        tmp_path / "dev-v2.0.json",
        [
            qa("h", [("dog", 34)], is_impossible=False),
            qa("n", [], is_impossible=True, plausible_answers=[{"text": "x", "answer_start": 0}]),
            qa("m", [("cat", 4)]),  # no is_impossible
            qa("w", [("cat", 4)], is_impossible=True),  # impossible yet answered
            qa("e", [], is_impossible=False),  # answerable yet no answer
        ],
        version="2.0 draft",
    )
    with pytest.raises(EvalDataError, match=r"version '2\.0 draft' is not one of.*pass version="):
        read_squad(path)
    examples, problems = read_squad(path, version="2.0")
    assert [(e.id, e.is_impossible, len(e.answers)) for e in examples] == [
        ("h", False, 1),
        ("n", True, 0),
    ]
    assert [(p.where, p.message.split(";")[0]) for p in problems] == [
        ("file", "version '2.0 draft', read as SQuAD 2.0 as asked"),
        ("question m", 'no boolean "is_impossible" (SQuAD 2.0)'),
        ("question w", "is_impossible but has answers"),
        ("question e", "no usable answer"),
    ]


def test_squad_missing_or_bad_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="expected a SQuAD JSON file"):
        read_squad(tmp_path / "dev-v1.1.json")
    (tmp_path / "bad.json").write_text('{"version": "1.1", "data": [', encoding="utf-8")
    with pytest.raises(EvalDataError, match=r"bad\.json: not JSON"):
        read_squad(tmp_path / "bad.json")
    (tmp_path / "nodata.json").write_text('{"version": "1.1"}', encoding="utf-8")
    with pytest.raises(EvalDataError, match="expected a SQuAD object"):
        read_squad(tmp_path / "nodata.json")


def test_squad_bad_paragraph_is_named(tmp_path):
    data = {"version": "1.1", "data": [{"title": "T", "paragraphs": [{"qas": [qa("z", [])]}]}]}
    (tmp_path / "p.json").write_text(json.dumps(data), encoding="utf-8")
    examples, problems = read_squad(tmp_path / "p.json")
    assert examples == []
    assert str(problems[0]).endswith(
        'article 0 paragraph 0: needs a string "context" and a "qas" list; skipped (1 questions)'
    )


# ----------------------------------------------------------------------------- RACE


def race_record(n, answers, file_id=None, n_options=4):
    record = {
        "article": "Tom has a red ball. He plays with it every day.",
        "questions": [f"Question {i}?" for i in range(n)],
        "options": [[f"opt{i}{k}" for k in range(n_options)] for i in range(n)],
        "answers": answers,
    }
    if file_id is not None:
        record["id"] = file_id
    return record


@pytest.fixture
def race_root(tmp_path):
    root = tmp_path / "RACE"
    for level in ("high", "middle"):
        (root / "dev" / level).mkdir(parents=True)
    high = root / "dev" / "high"
    (high / "1.txt").write_text(json.dumps(race_record(2, ["B", "D"], "high1.txt")))
    (high / "2.txt").write_text('{"article": "Broken", "questions": [')  # bad JSON
    (high / "notes.md").write_text("not a RACE file")
    middle = root / "dev" / "middle"
    (middle / "7.txt").write_text(json.dumps(race_record(3, ["A", "E", "C"])))  # no id, bad E
    (middle / "8.txt").write_text(json.dumps(race_record(1, ["A"], "middle8.txt", n_options=3)))
    (middle / "9.txt").write_text(json.dumps(race_record(2, ["A"], "middle9.txt")))
    bad = race_record(1, ["A"], "middle10.txt")
    del bad["article"]
    (middle / "10.txt").write_text(json.dumps(bad))
    return root


def test_race_reads_questions_and_names_problems(race_root):
    examples, problems = read_race(race_root, "dev")
    assert [(e.id, e.level, e.label) for e in examples] == [
        ("high1.txt-0", "high", 1),
        ("high1.txt-1", "high", 3),
        ("middle/7.txt-0", "middle", 0),
        ("middle/7.txt-2", "middle", 2),
    ]
    first = examples[0]
    assert first == RaceExample(
        id="high1.txt-0",
        level="high",
        article="Tom has a red ball. He plays with it every day.",
        question="Question 0?",
        options=("opt00", "opt01", "opt02", "opt03"),
        label=1,
        path=str(race_root / "dev" / "high" / "1.txt"),
    )
    found = [(p.path.split("RACE")[1], p.where, p.message) for p in problems]
    assert len(found) == 5
    assert found[0][:2] == ("/dev/high/2.txt", "line 1") and found[0][2].startswith("not JSON")
    assert found[1] == ("/dev/middle/10.txt", "file", "missing or ill-typed article; file skipped")
    assert found[2] == (
        "/dev/middle/7.txt",
        "question 1",
        "unknown answer 'E' (expected A, B, C or D); skipped",
    )
    assert found[3] == ("/dev/middle/8.txt", "question 0", "options must be 4 strings; skipped")
    assert found[4][0] == "/dev/middle/9.txt" and "differ in length" in found[4][2]


def test_race_levels_and_strict(race_root):
    high, problems = read_race(race_root, "dev", levels=["high"])
    assert len(high) == 2 and len(problems) == 1
    with pytest.raises(ValueError, match=r"5 problem\(s\) reading .*dev"):
        read_race(race_root, "dev", strict=True)


def test_race_missing_directories(tmp_path, race_root):
    with pytest.raises(FileNotFoundError, match="expected the RACE directory with train/, dev/"):
        read_race(tmp_path / "nope", "dev")
    with pytest.raises(FileNotFoundError, match="test: no such directory"):
        read_race(race_root, "test")
    (race_root / "train" / "high").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"train/middle/ folder of \*\.txt"):
        read_race(race_root, "train")
    (race_root / "train" / "middle").mkdir()
    examples, problems = read_race(race_root, "train")
    assert examples == [] and [p.message for p in problems] == ["no *.txt files"] * 2


def test_squad_version_from_the_file(tmp_path):
    # The official files say "1.1" and "v2.0".
    v2 = squad_file(tmp_path / "v2.json", [qa("n", [], is_impossible=True)], version="v2.0")
    (example,), problems = read_squad(v2)
    assert example.is_impossible and problems == []
    v1 = squad_file(tmp_path / "v1.json", [qa("q", [("cat", 4)])], version="1.1")
    (example,), problems = read_squad(v1)
    assert not example.is_impossible and problems == []
    # A file whose version contradicts the one asked for is refused, naming both.
    with pytest.raises(EvalDataError, match=r"'v2\.0' \(SQuAD 2\.0\), but squad1 reads SQuAD 1\.1"):
        read_squad(v2, version="1.1")
    with pytest.raises(EvalDataError, match=r"megaeval finetune squad1"):
        read_squad(v1, version="2.0")
    # Files published in the SQuAD format by other data sets carry no version: the task says.
    data = json.loads(v2.read_text())
    del data["version"]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(data))
    (example,), problems = read_squad(bare, version="2.0")
    assert example.is_impossible and problems == []
    with pytest.raises(EvalDataError, match=r"version None is not one of"):
        read_squad(bare)


# ----------------------------------------------------------------------------- real rows

# `make finetune-data` (which `make test` runs) puts real rows of every task here.
REAL = Path(__file__).resolve().parents[3] / "data" / "finetune"
NOT_FETCHED = f"no {REAL}/SOURCES.json: run `make finetune-data` to test on real task rows"


@pytest.mark.skipif(not (REAL / "SOURCES.json").is_file(), reason=NOT_FETCHED)
def test_real_rows_are_read_whole():
    """Every fetched file reads with no problem and no row lost: the counts are the ones
    fetch_finetune_data.py took from the files themselves (rows, questions, passages)."""
    from megaeval.finetune.tasks import TASKS, read_split

    sources = json.loads((REAL / "SOURCES.json").read_text())["tasks"]
    counted = {f["file"]: f for s in sources.values() for f in s["files"]}
    split_files = {
        "mnli": {s: f"mnli/{s}.tsv" for s in ("train", "dev_matched", "dev_mismatched")},
        "qqp": {s: f"qqp/{s}.tsv" for s in ("train", "dev")},
        "squad1": {"train": "squad1/train-v1.1.json", "dev": "squad1/dev-v1.1.json"},
        "squad2": {"train": "squad2/train-v2.0.json", "dev": "squad2/dev-v2.0.json"},
    }
    for task, files in split_files.items():
        for split, name in files.items():
            examples, problems = read_split(TASKS[task], REAL / task, split)
            assert problems == [], (name, problems[:3])
            expected = counted[name].get("rows", counted[name].get("questions"))
            assert len(examples) == expected > 0, name
    # As published, the SQuAD-format files carry no "version": the task says which.
    for name in ("squad1/train-v1.1.json", "squad1/dev-v1.1.json", "squad2/dev-v2.0.json"):
        assert "version" not in json.loads((REAL / name).read_text()), name
    dev2, _ = read_split(TASKS["squad2"], REAL / "squad2", "dev")
    assert sum(e.is_impossible for e in dev2) == counted["squad2/dev-v2.0.json"]["unanswerable"]
    assert all(e.answers for e in dev2 if not e.is_impossible)
    for split in ("train", "dev", "test"):
        examples, problems = read_split(TASKS["race"], REAL / "race", split)
        passages = [f for f in counted if f.startswith(f"race/{split}/")]
        questions = sum(counted[f]["questions"] for f in passages)
        assert problems == [] and len(examples) == questions > 0, split
        assert {e.level for e in examples} == {"high", "middle"}
