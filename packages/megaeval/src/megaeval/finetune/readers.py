"""Readers for the fine-tuning datasets of the Megatron-LM paper's Table 5, in official formats.

* GLUE MNLI and QQP: the TSV files of GLUE's MNLI.zip / QQP.zip (`read_mnli`, `read_qqp`).
  Columns are found by header name, never by position. Quoting is off (as csv.QUOTE_NONE):
  GLUE text holds stray double quotes, so a line is split on tabs and nothing else, and a
  line ends at "\\n" only (a stray "\\r" inside a field does not end a row). Labels:
  `MNLI_LABELS` = {"contradiction": 0, "entailment": 1, "neutral": 2}, the order of
  Megatron-LM's tasks/glue/mnli.py; `QQP_LABELS` = {"0": 0, "1": 1} (1 = duplicate).
  The test splits have no labels: their examples carry `label=None`.
* SQuAD v1.1 and v2.0: train-v1.1.json / dev-v1.1.json / train-v2.0.json / dev-v2.0.json
  (`read_squad`). One `SquadExample` per question with all its answers (dev has several).
* RACE: the RACE.tar.gz tree `ROOT/{train,dev,test}/{high,middle}/*.txt` (`read_race`), one
  `RaceExample` per question, labels "A".."D" -> 0..3 (`RACE_LABELS`).

What no reader does quietly: a row it cannot use (wrong column count, unknown label, empty
text, bad JSON, a missing or ill-typed field, a duplicate id) becomes a `Problem` naming the
file and the line number or question id. Every reader returns a `ReadResult` (the examples
and the problems; it unpacks as `examples, problems = read_...(...)`), and with
`strict=True` raises `EvalDataError` (a ValueError) listing the first problems and their
count instead. A missing file or directory raises FileNotFoundError naming the path and what
was expected there; a file that cannot be read at all (an empty TSV, a header without the
needed columns, a SQuAD file that is not JSON) raises EvalDataError whatever `strict` says.

Decisions, all recorded as problems:
* GLUE rows with an empty sentence/question are skipped, as Megatron-LM's tasks/glue readers
  skip them ("zero length a/b").
* A SQuAD answer whose text is not at `answer_start` in the context is moved to the
  occurrence of its text nearest to `answer_start` (`fix_offsets=True`, the default) and
  kept; if the text occurs nowhere in the context (or `fix_offsets=False`), that answer is
  skipped, and a question left with no usable answer (and not `is_impossible`) is skipped.
* A duplicate id (MNLI index, QQP id, SQuAD question id, RACE file id) skips the later row.
* SQuAD v2 `plausible_answers` are not kept (Megatron does not train on them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from megaeval.errors import EvalDataError

MNLI_LABELS: dict[str, int] = {"contradiction": 0, "entailment": 1, "neutral": 2}
QQP_LABELS: dict[str, int] = {"0": 0, "1": 1}
RACE_LABELS: dict[str, int] = {"A": 0, "B": 1, "C": 2, "D": 3}

MNLI_SPLITS = ("train", "dev_matched", "dev_mismatched", "test_matched", "test_mismatched")
QQP_SPLITS = ("train", "dev", "test")
RACE_SPLITS = ("train", "dev", "test")
RACE_LEVELS = ("high", "middle")
SQUAD_VERSIONS = ("1.1", "2.0")
SQUAD_TASKS = {"1.1": "squad1", "2.0": "squad2"}  # the `megaeval finetune` task of each

# How many problems a strict reader's error lists before "... and N more".
STRICT_SHOWN = 5

_MNLI_DIR = (
    "the GLUE MNLI directory with train.tsv, dev_matched.tsv, dev_mismatched.tsv, "
    "test_matched.tsv, test_mismatched.tsv"
)
_QQP_DIR = "the GLUE QQP directory with train.tsv, dev.tsv, test.tsv"
_RACE_DIR = (
    "the RACE directory with train/, dev/, test/, each holding high/ and middle/ *.txt files"
)


@dataclass(frozen=True)
class Problem:
    """A row, question or file a reader could not use: where it is and why."""

    path: str
    where: str  # "line 7", "question 5733be28...", "question 2", "file"
    message: str

    def __str__(self) -> str:
        return f"{self.path}, {self.where}: {self.message}"


E = TypeVar("E")


@dataclass
class ReadResult(Generic[E]):
    """The examples a reader could use and the problems it found (unpacks as a pair)."""

    examples: list[E]
    problems: list[Problem]

    def __iter__(self) -> Iterator[Any]:
        return iter((self.examples, self.problems))

    def __len__(self) -> int:
        return len(self.examples)


@dataclass(frozen=True)
class PairExample:
    """A sentence-pair classification example (MNLI premise/hypothesis, QQP question pair)."""

    uid: str  # MNLI `index`, QQP `id`
    text_a: str  # MNLI sentence1, QQP question1
    text_b: str  # MNLI sentence2, QQP question2
    label: int | None  # MNLI_LABELS / QQP_LABELS id; None in the test splits
    line: int  # line number in its TSV file (the header is line 1)
    genre: str | None = None  # MNLI only


@dataclass(frozen=True)
class SquadAnswer:
    text: str
    answer_start: int  # character offset in the context


@dataclass(frozen=True)
class SquadExample:
    """One SQuAD question with its context and every gold answer."""

    id: str
    question: str
    context: str
    answers: tuple[SquadAnswer, ...]  # empty for a v2 is_impossible question
    is_impossible: bool = False  # always False for v1.1
    title: str = ""


@dataclass(frozen=True)
class RaceExample:
    """One RACE question: its article, the four options and the answer's index."""

    id: str  # "<file id>-<question index>", the file id being the JSON "id" or "level/name.txt"
    level: str  # "high" or "middle"
    article: str
    question: str
    options: tuple[str, str, str, str]
    label: int  # RACE_LABELS: "A".."D" -> 0..3
    path: str


def _finish(result: ReadResult[E], strict: bool, what: str) -> ReadResult[E]:
    if strict and result.problems:
        n = len(result.problems)
        shown = "\n".join(f"  {p}" for p in result.problems[:STRICT_SHOWN])
        more = f"\n  ... and {n - STRICT_SHOWN} more" if n > STRICT_SHOWN else ""
        raise EvalDataError(f"{n} problem(s) reading {what}:\n{shown}{more}")
    return result


def _require_dir(path: str, expected: str) -> None:
    if not os.path.isdir(path):
        state = "not a directory" if os.path.exists(path) else "no such directory"
        raise FileNotFoundError(f"{path}: {state} (expected {expected})")


def _require_file(path: str, expected: str) -> None:
    if not os.path.isfile(path):
        state = "not a file" if os.path.exists(path) else "no such file"
        raise FileNotFoundError(f"{path}: {state} (expected {expected})")


# ----------------------------------------------------------------------------- GLUE TSV


def _tsv_rows(path: str, problems: list[Problem]) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) of each line, split on tabs only; undecodable lines are problems."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            raw = raw.removesuffix(b"\n").removesuffix(b"\r")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                problems.append(Problem(path, f"line {number}", f"not UTF-8 ({e.reason})"))
                continue
            if number == 1:
                text = text.removeprefix("\ufeff")
            yield number, text.split("\t")


def _read_pair_tsv(
    path: str,
    *,
    task: str,
    id_col: str,
    a_col: str,
    b_col: str,
    label_col: str | None,
    labels: dict[str, int],
    genre_col: str | None = None,
) -> ReadResult[PairExample]:
    problems: list[Problem] = []
    examples: list[PairExample] = []
    rows = _tsv_rows(path, problems)
    needed = [c for c in (id_col, a_col, b_col, label_col, genre_col) if c is not None]
    header = next(rows, None)
    if header is None:
        raise EvalDataError(f"{path}: empty file (expected a {task} TSV header with {needed})")
    _, columns = header
    missing = [c for c in needed if c not in columns]
    if missing:
        raise EvalDataError(
            f"{path}: the header has no column {', '.join(map(repr, missing))} "
            f"(a {task} TSV needs {needed}; the header is {columns})"
        )
    index = {name: columns.index(name) for name in needed}
    seen: set[str] = set()
    for number, fields in rows:
        where = f"line {number}"
        if fields == [""]:
            problems.append(Problem(path, where, "blank line"))
            continue
        if len(fields) != len(columns):
            problems.append(
                Problem(
                    path,
                    where,
                    f"{len(fields)} column(s), expected {len(columns)} as in the header",
                )
            )
            continue
        uid = fields[index[id_col]].strip()
        text_a = fields[index[a_col]]
        text_b = fields[index[b_col]]
        label = None
        if label_col is not None:
            value = fields[index[label_col]].strip()
            if value not in labels:
                problems.append(
                    Problem(
                        path,
                        where,
                        f"unknown {label_col} {value!r} (expected one of {sorted(labels)})",
                    )
                )
                continue
            label = labels[value]
        empty = [c for c, t in ((a_col, text_a), (b_col, text_b)) if not t.strip()]
        if empty:
            problems.append(Problem(path, where, f"empty {' and '.join(empty)}; row skipped"))
            continue
        if uid in seen:
            problems.append(Problem(path, where, f"duplicate {id_col} {uid!r}; row skipped"))
            continue
        seen.add(uid)
        genre = fields[index[genre_col]] if genre_col is not None else None
        examples.append(PairExample(uid, text_a, text_b, label, number, genre))
    return ReadResult(examples, problems)


def read_mnli_file(
    path: str | os.PathLike, *, labeled: bool = True, strict: bool = False
) -> ReadResult[PairExample]:
    """One GLUE MNLI TSV: index, genre, sentence1, sentence2 and (if `labeled`) gold_label."""
    path = os.fspath(path)
    _require_file(path, "a GLUE MNLI TSV file")
    result = _read_pair_tsv(
        path,
        task="GLUE MNLI",
        id_col="index",
        a_col="sentence1",
        b_col="sentence2",
        label_col="gold_label" if labeled else None,
        labels=MNLI_LABELS,
        genre_col="genre",
    )
    return _finish(result, strict, path)


def read_qqp_file(
    path: str | os.PathLike, *, labeled: bool = True, strict: bool = False
) -> ReadResult[PairExample]:
    """One GLUE QQP TSV: id, question1, question2 and (if `labeled`) is_duplicate."""
    path = os.fspath(path)
    _require_file(path, "a GLUE QQP TSV file")
    result = _read_pair_tsv(
        path,
        task="GLUE QQP",
        id_col="id",
        a_col="question1",
        b_col="question2",
        label_col="is_duplicate" if labeled else None,
        labels=QQP_LABELS,
    )
    return _finish(result, strict, path)


def read_mnli(
    data_dir: str | os.PathLike, split: str, *, strict: bool = False
) -> ReadResult[PairExample]:
    """The MNLI `split` (one of MNLI_SPLITS) of a GLUE MNLI directory; test splits unlabeled."""
    if split not in MNLI_SPLITS:
        raise ValueError(f"unknown MNLI split {split!r} (expected one of {MNLI_SPLITS})")
    data_dir = os.fspath(data_dir)
    _require_dir(data_dir, _MNLI_DIR)
    path = os.path.join(data_dir, f"{split}.tsv")
    _require_file(path, f"the MNLI {split} split in {_MNLI_DIR}")
    return read_mnli_file(path, labeled=not split.startswith("test"), strict=strict)


def read_qqp(
    data_dir: str | os.PathLike, split: str, *, strict: bool = False
) -> ReadResult[PairExample]:
    """The QQP `split` (one of QQP_SPLITS) of a GLUE QQP directory; the test split unlabeled."""
    if split not in QQP_SPLITS:
        raise ValueError(f"unknown QQP split {split!r} (expected one of {QQP_SPLITS})")
    data_dir = os.fspath(data_dir)
    _require_dir(data_dir, _QQP_DIR)
    path = os.path.join(data_dir, f"{split}.tsv")
    _require_file(path, f"the QQP {split} split in {_QQP_DIR}")
    return read_qqp_file(path, labeled=split != "test", strict=strict)


# ----------------------------------------------------------------------------- SQuAD


def _nearest_occurrence(context: str, text: str, start: int) -> int | None:
    best = None
    i = context.find(text)
    while i != -1:
        if best is None or abs(i - start) < abs(best - start):
            best = i
        i = context.find(text, i + 1)
    return best


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _squad_answers(
    raw: Any,
    context: str,
    *,
    path: str,
    where: str,
    fix_offsets: bool,
    problems: list[Problem],
) -> list[SquadAnswer] | None:
    """The usable answers of a question; None (with a problem) if `raw` is not a list."""
    if not isinstance(raw, list):
        problems.append(Problem(path, where, '"answers" is missing or not a list'))
        return None
    answers = []
    for k, answer in enumerate(raw):
        text = answer.get("text") if isinstance(answer, dict) else None
        start = answer.get("answer_start") if isinstance(answer, dict) else None
        if not isinstance(text, str) or not _is_int(start):
            problems.append(
                Problem(path, where, f'answer {k}: needs a string "text" and an int "answer_start"')
            )
            continue
        if not text:
            problems.append(Problem(path, where, f"answer {k}: empty text; skipped"))
            continue
        if context[start : start + len(text)] == text:
            answers.append(SquadAnswer(text, start))
            continue
        found = _nearest_occurrence(context, text, start) if fix_offsets else None
        if found is not None:
            problems.append(
                Problem(
                    path,
                    where,
                    f"answer {k} {text!r} is not at answer_start {start}; "
                    f"found nearest at {found} and moved there",
                )
            )
            answers.append(SquadAnswer(text, found))
        else:
            reason = "not found in the context" if fix_offsets else "fix_offsets is off"
            problems.append(
                Problem(
                    path,
                    where,
                    f"answer {k} {text!r} is not at answer_start {start} ({reason}); skipped",
                )
            )
    return answers


def read_squad(
    path: str | os.PathLike,
    *,
    version: str | None = None,
    fix_offsets: bool = True,
    strict: bool = False,
) -> ReadResult[SquadExample]:
    """A SQuAD v1.1 or v2.0 JSON file (train or dev): one `SquadExample` per question.

    `version` ("1.1" or "2.0"; `megaeval finetune squad1` / `squad2` pass theirs) is what a
    file without a "version" field is read as: files published in the SQuAD format by other
    data sets (MLQA, XQuAD, CUAD, many mirrors) carry none.  A file whose "version" is 1.1 or
    2.0 (the official files say "1.1" and "v2.0"; a leading "v" is ignored) is read as that,
    and refused when `version` asks for the other one.  An unrecognised "version" is read as
    asked, with a problem recorded.  v2.0 questions need "is_impossible"; an impossible one
    has no answers, any other at least one.
    """
    path = os.fspath(path)
    _require_file(path, "a SQuAD JSON file (train-v1.1.json, dev-v2.0.json, ...)")
    try:
        with open(path, encoding="utf-8") as f:
            dataset = json.load(f)
    except UnicodeDecodeError:
        raise EvalDataError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise EvalDataError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(dataset, dict) or not isinstance(dataset.get("data"), list):
        raise EvalDataError(f'{path}: expected a SQuAD object {{"version": ..., "data": [...]}}')
    problems: list[Problem] = []
    file_version = dataset.get("version")
    found = file_version.removeprefix("v") if isinstance(file_version, str) else None
    if version is not None and version not in SQUAD_VERSIONS:
        raise ValueError(f"unknown SQuAD version {version!r} (expected one of {SQUAD_VERSIONS})")
    if version is None:
        if found not in SQUAD_VERSIONS:
            raise EvalDataError(
                f"{path}: version {file_version!r} is not one of {SQUAD_VERSIONS}; "
                "pass version= to read it (megaeval finetune squad1 / squad2 pass theirs)"
            )
        version = found
    elif found in SQUAD_VERSIONS and found != version:
        raise EvalDataError(
            f'{path}: the file says "version": {file_version!r} (SQuAD {found}), but '
            f"{SQUAD_TASKS[version]} reads SQuAD {version}: fine-tune on it with "
            f"`megaeval finetune {SQUAD_TASKS[found]}`, or give {SQUAD_TASKS[version]} "
            f"SQuAD {version} files"
        )
    elif file_version is not None and found != version:
        problems.append(
            Problem(path, "file", f"version {file_version!r}, read as SQuAD {version} as asked")
        )
    v2 = version == "2.0"

    examples: list[SquadExample] = []
    seen: set[str] = set()
    for ai, article in enumerate(dataset["data"]):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            problems.append(Problem(path, f"article {ai}", 'no "paragraphs" list; skipped'))
            continue
        title = article.get("title", "")
        title = title if isinstance(title, str) else ""
        for pi, paragraph in enumerate(paragraphs):
            place = f"article {ai} paragraph {pi}"
            context = paragraph.get("context") if isinstance(paragraph, dict) else None
            qas = paragraph.get("qas") if isinstance(paragraph, dict) else None
            if not isinstance(context, str) or not isinstance(qas, list):
                count = f" ({len(qas)} questions)" if isinstance(qas, list) else ""
                problems.append(
                    Problem(
                        path, place, f'needs a string "context" and a "qas" list; skipped{count}'
                    )
                )
                continue
            for qi, qa in enumerate(qas):
                qid = qa.get("id") if isinstance(qa, dict) else None
                if not isinstance(qid, str) or not qid:
                    problems.append(
                        Problem(path, f"{place} question {qi}", 'no string "id"; skipped')
                    )
                    continue
                where = f"question {qid}"
                question = qa.get("question")
                if not isinstance(question, str):
                    problems.append(Problem(path, where, 'no string "question"; skipped'))
                    continue
                impossible = qa.get("is_impossible", False) if v2 else False
                if v2 and not isinstance(qa.get("is_impossible"), bool):
                    problems.append(
                        Problem(path, where, 'no boolean "is_impossible" (SQuAD 2.0); skipped')
                    )
                    continue
                answers = _squad_answers(
                    qa.get("answers"),
                    context,
                    path=path,
                    where=where,
                    fix_offsets=fix_offsets,
                    problems=problems,
                )
                if answers is None:
                    continue
                if impossible and qa["answers"]:
                    problems.append(Problem(path, where, "is_impossible but has answers; skipped"))
                    continue
                if not impossible and not answers:
                    problems.append(Problem(path, where, "no usable answer; skipped"))
                    continue
                if qid in seen:
                    problems.append(Problem(path, where, "duplicate question id; skipped"))
                    continue
                seen.add(qid)
                examples.append(
                    SquadExample(qid, question, context, tuple(answers), impossible, title)
                )
    return _finish(ReadResult(examples, problems), strict, path)


# ----------------------------------------------------------------------------- RACE


def _race_file(
    path: str, level: str, file_label: str, problems: list[Problem]
) -> list[RaceExample]:
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except UnicodeDecodeError:
        problems.append(Problem(path, "file", "not UTF-8 text; skipped"))
        return []
    except json.JSONDecodeError as e:
        problems.append(
            Problem(path, f"line {e.lineno}", f"not JSON ({e.msg}, column {e.colno}); skipped")
        )
        return []
    if not isinstance(record, dict):
        problems.append(Problem(path, "file", "not a JSON object; skipped"))
        return []
    article = record.get("article")
    lists = {k: record.get(k) for k in ("questions", "options", "answers")}
    bad = [k for k, v in lists.items() if not isinstance(v, list)]
    if not isinstance(article, str):
        bad.insert(0, "article")
    if bad:
        problems.append(
            Problem(path, "file", f"missing or ill-typed {', '.join(bad)}; file skipped")
        )
        return []
    lengths = {k: len(v) for k, v in lists.items()}
    if len(set(lengths.values())) != 1:
        problems.append(
            Problem(
                path, "file", f"questions, options, answers differ in length {lengths}; skipped"
            )
        )
        return []
    file_id = record.get("id")
    file_id = file_id if isinstance(file_id, str) and file_id else file_label
    examples = []
    for i, (question, options, answer) in enumerate(
        zip(lists["questions"], lists["options"], lists["answers"], strict=True)
    ):
        where = f"question {i}"
        if not isinstance(question, str):
            problems.append(Problem(path, where, "question is not a string; skipped"))
            continue
        if (
            not isinstance(options, list)
            or len(options) != 4
            or not all(isinstance(o, str) for o in options)
        ):
            problems.append(Problem(path, where, "options must be 4 strings; skipped"))
            continue
        if answer not in RACE_LABELS:
            problems.append(
                Problem(path, where, f"unknown answer {answer!r} (expected A, B, C or D); skipped")
            )
            continue
        examples.append(
            RaceExample(
                id=f"{file_id}-{i}",
                level=level,
                article=article,
                question=question,
                options=(options[0], options[1], options[2], options[3]),
                label=RACE_LABELS[answer],
                path=path,
            )
        )
    return examples


def read_race(
    root: str | os.PathLike,
    split: str,
    *,
    levels: Sequence[str] = RACE_LEVELS,
    strict: bool = False,
) -> ReadResult[RaceExample]:
    """The RACE `split` (train, dev or test) under `root`: every `level/*.txt`, in name order.

    Each file is one JSON object {"article", "questions", "options", "answers", "id"}; an
    example's id is "<id>-<question index>", with "<level>/<file name>" standing in for a
    missing "id". Files not ending in .txt are not read; a level directory without any .txt
    file is a problem.
    """
    if split not in RACE_SPLITS:
        raise ValueError(f"unknown RACE split {split!r} (expected one of {RACE_SPLITS})")
    unknown = [lv for lv in levels if lv not in RACE_LEVELS]
    if unknown or not levels:
        raise ValueError(f"unknown RACE levels {list(levels)} (expected some of {RACE_LEVELS})")
    root = os.fspath(root)
    _require_dir(root, _RACE_DIR)
    split_dir = os.path.join(root, split)
    _require_dir(split_dir, f"RACE's {split}/ folder with high/ and middle/ in {_RACE_DIR}")
    problems: list[Problem] = []
    examples: list[RaceExample] = []
    seen: set[str] = set()
    for level in levels:
        level_dir = os.path.join(split_dir, level)
        _require_dir(level_dir, f"RACE's {split}/{level}/ folder of *.txt files")
        names = sorted(n for n in os.listdir(level_dir) if n.endswith(".txt"))
        if not names:
            problems.append(Problem(level_dir, "directory", "no *.txt files"))
        for name in names:
            path = os.path.join(level_dir, name)
            for example in _race_file(path, level, f"{level}/{name}", problems):
                if example.id in seen:
                    problems.append(
                        Problem(path, "file", f"duplicate example id {example.id!r}; skipped")
                    )
                    continue
                seen.add(example.id)
                examples.append(example)
    return _finish(ReadResult(examples, problems), strict, split_dir)
