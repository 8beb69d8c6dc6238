"""The held-out evaluation files: WikiText-103's raw format, LAMBADA-style passages, the split.

The recipe-level checks (held-out documents absent from the shards, a rerun giving the same
bytes) are in test_decontaminate.py, which builds one corpus with both new stages.
"""

import re

import pytest

from megadata.documents import write_docs
from megadata.stages import holdout
from megadata.wikitext_format import format_article, format_articles, split_articles, tokenize

BOULTER = (
    "Robert Boulter is an English film, television and theatre actor. He had a guest-starring "
    'role on the television series The Bill in 2000. In 2004 he landed a role as "Craig" in '
    'the episode "Teddy\'s Story" (The Long Firm); it cost 1,250,000 dollars, 3.5 times more.\n'
    "He was cast in the 2005 theatre productions of the Harold Pinter play Celebration.\n\n"
    "Career\n"
    "In 2000 Boulter had a guest-starring role on the television series The Bill."
)


def test_wikitext_tokens_like_the_real_file():
    assert format_article("Robert Boulter", BOULTER) == (
        " \n"
        " = Robert Boulter = \n"
        " \n"
        " Robert Boulter is an English film , television and theatre actor . He had a guest @-@ "
        "starring role on the television series The Bill in 2000 . In 2004 he landed a role as "
        '" Craig " in the episode " Teddy \'s Story " ( The Long Firm ) ; it cost 1 @,@ 250 @,@ '
        "000 dollars , 3 @.@ 5 times more . \n"
        " He was cast in the 2005 theatre productions of the Harold Pinter play Celebration . \n"
        " \n"
        " = = Career = = \n"
        " \n"
        " In 2000 Boulter had a guest @-@ starring role on the television series The Bill . \n"
    )


def test_moses_with_its_letter_sets_made_once_is_moses(documents):
    from sacremoses import MosesTokenizer

    from megadata.wikitext_format import _moses

    plain = MosesTokenizer(lang="en")
    lines = [line for d in documents[:60] for line in d["text"].split("\n") if line.strip()]
    lines += ["e.g. x. U.S.A. then a.b.c. Mr. Smith. ß. Σ. ÉCOLE. 3. no.", "A. b. Ü. é. 1.2."]
    for line in lines:
        args = {"aggressive_dash_splits": True, "escape": False, "return_str": True}
        assert _moses().tokenize(line, **args) == plain.tokenize(line, **args), line


def test_untitled_documents_get_their_first_words_and_split_back():
    text = format_articles(
        [("", "Hundreds of people have been forced to leave, officials said."), ("B", BOULTER)]
    )
    assert text.startswith(" \n = Hundreds of people have been forced = \n \n Hundreds of")
    assert [t for t, _ in split_articles(text)] == ["Hundreds of people have been forced", "B"]
    body = split_articles(text)[1][1]
    assert "= = Career = =" in body and body.startswith("Robert Boulter is")
    assert all(line.startswith(" ") and line.endswith(" ") for line in text.splitlines())
    assert format_article("Empty", "  \n\n ") == ""
    assert tokenize("A well-known 10.5-ton truck.") == "A well @-@ known 10 @.@ 5 @-@ ton truck ."


def test_lambada_passages_end_in_a_word_and_respect_the_bounds(documents):
    text = " ".join(d["text"].replace("\n", " ") for d in documents[:6])
    passages = holdout.lambada_passages(text, 60, 120, limit=50)
    assert len(passages) >= 5
    for p in passages:
        words = p.split()
        assert 60 <= len(words) <= 120, p
        assert re.fullmatch(r"[A-Za-z]+", words[-1]), p
        assert p in " ".join(text.split()) or p.rsplit(" ", 1)[0] in " ".join(text.split())
    assert holdout.lambada_passages(text, 60, 120, limit=3) == passages[:3]
    assert holdout.lambada_passages("Too short. Far too short.", 60, 120, limit=3) == []


def test_selection_is_stable_and_about_one_in_every():
    ids = [f"src/file.txt#{i}" for i in range(4000)]
    held = [i for i in ids if holdout.is_held_out(i, 40)]
    assert 70 <= len(held) <= 130  # 100 expected
    assert held == [i for i in ids if holdout.is_held_out(i, 40)]
    # Independent of the shard stage's valid split (the same ids unsalted).
    from megadata.stages.shard import is_valid_doc

    assert [i for i in ids if is_valid_doc(i, 40)] != held


def test_bad_settings_name_the_field():
    assert holdout.settings({}).every == 40
    with pytest.raises(ValueError, match=r"\[holdout\] every must be a positive integer"):
        holdout.settings({"every": "often"})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['evry'\]"):
        holdout.settings({"evry": 3})


def test_eval_files_from_the_split_equal_those_formatted_at_the_join(
    tmp_path, documents, monkeypatch, caplog
):
    """split_partition formats its held-out documents in parallel; a partition split by an
    earlier megadata (no NAME.eval.json) is formatted by write_eval_files: the same bytes.
    Held-out text over LARGE_EVAL_BYTES gets a warning that names [holdout] every."""
    cfg = holdout.settings({"every": 2, "lambada_per_doc": 3})
    rows = [{**d, "doc_id": f"t/{i}"} for i, d in enumerate(documents[:40])]
    write_docs(tmp_path / "in.arrow", rows)
    held, formatted = tmp_path / "held" / "p.arrow", tmp_path / "held" / "p.eval.json"
    split = holdout.split_partition(
        str(tmp_path / "in.arrow"), str(tmp_path / "out.arrow"), str(held), 2, [],
        str(formatted), cfg, "blingfire",
    )  # fmt: skip
    assert split["extra"]["held_out"] > 0
    outputs = []
    for run in ("split", "join"):
        if run == "join":
            formatted.unlink()
        eval_dir = tmp_path / run
        counts = holdout.write_eval_files([str(formatted)], str(eval_dir), cfg, split, "blingfire")
        assert counts["extra"]["held_out"] == split["extra"]["held_out"]
        outputs.append([(eval_dir / f).read_bytes() for f in ("wiki.test.tokens", "lambada.jsonl")])
        assert counts["extra"]["wikitext_tokens"] == len(outputs[-1][0].split())
        assert counts["extra"]["lambada_passages"] == len(outputs[-1][1].splitlines())
        assert "raise [holdout] every" not in caplog.text
    assert outputs[0] == outputs[1] and outputs[0][0] and outputs[0][1]
    monkeypatch.setattr(holdout, "LARGE_EVAL_BYTES", 100)
    holdout.write_eval_files([str(formatted)], str(tmp_path / "big"), cfg, split, "blingfire")
    assert "raise [holdout] every (now 2)" in caplog.text
