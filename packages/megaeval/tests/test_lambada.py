import json

import pytest
from eval_inputs import LAMBADA, FakeScorer, fake_nll, write_lambada

from megaeval.errors import EvalDataError
from megaeval.lambada import evaluate_lambada, read_lambada, split_last_word


def test_split_last_word():
    assert split_last_word("He said  hello\n") == ("He said", "hello")
    assert split_last_word("one two") == ("one", "two")


@pytest.mark.parametrize(
    ("wrong", "strict_correct", "last_token_correct"),
    [
        ("", True, True),
        ("y", False, False),  # the target's first token right, its last one wrong
        ("x", False, True),  # the first one wrong, the last one right
    ],
)
def test_strict_needs_every_token_of_the_last_word(
    tmp_path, wrong, strict_correct, last_token_correct
):
    # One token per character, spaces dropped: the last word "xy" is a two-token target.
    path = write_lambada(tmp_path / "l.jsonl", ["the dog ate xy", "a cat sat on abc"])
    scorer = FakeScorer(wrong=wrong, drop_spaces=True)

    strict = evaluate_lambada(scorer, path, strict=True, batch_size=2, progress=False)
    assert scorer.calls[-1] == [scorer.encode("the dog ate xy"), scorer.encode("a cat sat on abc")]
    assert strict["examples"] == 2 and strict["target_tokens"] == 2 + 3
    assert strict["correct"] == 1 + strict_correct
    assert strict["accuracy"] == (1 + strict_correct) / 2
    # Entry i of a sequence's scores has context length i + 1.
    # "thedogatexy": x and y are tokens 9 and 10; "acatsatonabc": a, b, c are 9, 10, 11.
    expected = [fake_nll(9, ord("x")), fake_nll(10, ord("y"))]
    expected += [fake_nll(9, ord("a")), fake_nll(10, ord("b")), fake_nll(11, ord("c"))]
    assert strict["target_loss"] == pytest.approx(sum(expected) / 5, rel=1e-12)
    assert strict["strict"] is True

    loose = evaluate_lambada(scorer, path, strict=False, batch_size=2, progress=False)
    assert loose["target_tokens"] == 2
    assert loose["correct"] == 1 + last_token_correct
    expected = (fake_nll(10, ord("y")) + fake_nll(11, ord("c"))) / 2
    assert loose["target_loss"] == pytest.approx(expected, rel=1e-12)
    assert loose["strict"] is False


def test_strict_encodes_context_and_space_plus_last_word_separately(tmp_path):
    path = write_lambada(tmp_path / "l.jsonl", ["It was  a dark night "])
    scorer = FakeScorer()
    evaluate_lambada(scorer, path, progress=False)
    assert scorer.calls == [[scorer.encode("It was  a dark") + scorer.encode(" night")]]


def test_long_contexts_keep_their_last_tokens(tmp_path, capsys):
    path = write_lambada(tmp_path / "l.jsonl", ["a b c d e f g h i j k l m n o p", "short one"])
    scorer = FakeScorer(max_seq_len=8)
    result = evaluate_lambada(scorer, path, batch_size=8, progress=False)
    long_tokens = scorer.encode("a b c d e f g h i j k l m n o") + scorer.encode(" p")
    assert scorer.calls[0][0] == long_tokens[-9:]
    assert scorer.calls[0][1] == scorer.encode("short") + scorer.encode(" one")
    assert result["truncated"] == 1
    assert "1 of 2 contexts are longer" in capsys.readouterr().err


def test_batches_of_batch_size(tmp_path):
    path = write_lambada(tmp_path / "l.jsonl", [f"word number {i}" for i in range(7)])
    scorer = FakeScorer()
    result = evaluate_lambada(scorer, path, batch_size=3, progress=False)
    assert [len(call) for call in scorer.calls] == [3, 3, 1]
    assert result["examples"] == 7


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("", "empty file"),
        ("\n  \n", "empty file"),
        ('{"text": "one two"}\nnot json\n', ":2: not JSON"),
        ('{"text": "one two"}\n{"body": "one two"}\n', ':2: expected an object with a "text"'),
        ('["one two"]\n', ':1: expected an object with a "text"'),
        ('{"text": ""}\n', ':1: "text" must be a non-empty string'),
        ('{"text": "  "}\n', ':1: "text" must be a non-empty string'),
        ('{"text": 3}\n', ':1: "text" must be a non-empty string'),
        ('{"text": "one two"}\n\n{"text": " lonely "}\n', ':3: "text" has one word'),
    ],
)
def test_read_lambada_names_the_bad_file_and_line(tmp_path, content, message):
    path = tmp_path / "lambada_test.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(EvalDataError, match=message) as error:
        read_lambada(path)
    assert str(path) in str(error.value)


def test_read_lambada(lambada_file):
    assert read_lambada(lambada_file) == LAMBADA
    lines = lambada_file.read_text().splitlines()
    assert [json.loads(line)["text"] for line in lines] == LAMBADA


def test_tiny_gpt2_matches_a_direct_computation(tiny_gpt2, lambada_file):
    import torch
    import transformers
    from tokenizers import Tokenizer

    from megaeval.scoring import HFScorer

    scorer = HFScorer(tiny_gpt2, dtype="float64")
    result = evaluate_lambada(scorer, lambada_file, batch_size=2, progress=False)

    tokenizer = Tokenizer.from_file(str(tiny_gpt2 / "tokenizer.json"))
    model = transformers.GPT2LMHeadModel.from_pretrained(tiny_gpt2).to(torch.float64).eval()
    correct, nll, count = 0, 0.0, 0
    with torch.no_grad():
        for text in LAMBADA:
            context, last_word = text.rsplit(" ", 1)
            target = tokenizer.encode(" " + last_word).ids
            tokens = (tokenizer.encode(context).ids + target)[-33:]  # 32 positions
            log_probs = torch.log_softmax(model(torch.tensor([tokens[:-1]])).logits[0], dim=-1)
            n = len(target)
            predicted = log_probs[-n:].argmax(dim=-1).tolist()
            correct += predicted == target
            nll -= float(log_probs[-n:].gather(1, torch.tensor(target)[:, None]).sum())
            count += n
    assert result["examples"] == len(LAMBADA) and result["correct"] == correct
    assert result["target_tokens"] == count
    assert result["target_loss"] == pytest.approx(nll / count, rel=1e-9)
    assert result["truncated"] == len(LAMBADA)  # every passage is longer than 32 tokens
