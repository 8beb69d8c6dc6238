"""Small WikiText and LAMBADA files, a tiny Hugging Face GPT-2, and a scorer whose numbers
the tests know, shared by the megaeval tests."""

import json
from pathlib import Path

import numpy as np

from megaeval.scoring import TokenScores

# In the style of wiki.test.tokens: a leading blank line, " = Title = " and " = = Sub = = "
# headings, @-@ @,@ @.@ number marks, spaced punctuation, quotes and brackets, " N ".
WIKITEXT = (
    " \n"
    " = Harbour Lighthouse = \n"
    " \n"
    " The Harbour Lighthouse is a disused light on the north pier of a small fishing town . "
    "It stood 21 @.@ 5 metres ( 70 ft ) tall and was visible for 1 @,@ 200 yards in clear "
    'weather . Locals called it " the Old Light " , and the keepers \' cottage still stands . \n'
    " \n"
    " = = History = = \n"
    " \n"
    " Work began in 1868 and ended in 1872 ; the lamp was lit on a cold night at 2 ° C . "
    "A well @-@ known engineer , whose firm built N towers along the coast , drew the plans "
    "[ 3 ] . It 's said that the first keeper kept a log : every ship , every storm ! \n"
    " \n"
    " = = = Decline = = = \n"
    " \n"
    " By 1950 @-@ 51 the light was no longer needed . Why ? A new beacon ( electric , "
    "automatic ) replaced it , and the town 's council closed the ' Old Light ' for good . \n"
    " \n"
)

# In the style of the OpenAI lambada_test.jsonl: one passage per line, the last word to guess.
LAMBADA = [
    "The keeper climbed the stairs every night to light the lamp. When the storm came, he "
    "stayed awake until dawn, watching the sea from the top of the lighthouse",
    "She opened the old log and read the entries aloud. Every ship that passed was written "
    "down, and every storm was written down too. The last entry was about a storm",
    "The town council met in the hall. They talked for hours about the light, and in the end "
    "they voted to close the lighthouse",
]


def write_wikitext(path: Path, text: str = WIKITEXT) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def write_lambada(path: Path, texts: list[str] = LAMBADA) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def write_tiny_gpt2(model_dir: Path, n_positions: int = 32) -> Path:
    """save_pretrained of a random GPT-2 (2 layers, 64 dims) + a BPE tokenizer.json."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator([WIKITEXT, *LAMBADA], trainer)
    tokenizer.save(str(model_dir / "tokenizer.json"))

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=tokenizer.get_vocab_size(),
        n_positions=n_positions,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(model_dir)
    return model_dir


def fake_nll(context_len: int, token: int) -> float:
    """The fake model's loss: depends on the context length, so a wrong window shows."""
    return 0.001 * context_len + 0.1 * (token % 13) + 0.5


class FakeScorer:
    """A deterministic scorer: one token per character (spaces dropped if `drop_spaces`),
    nll = fake_nll(context length, target), and a prediction that is wrong exactly for the
    target tokens in `wrong`. It records every sequence it was asked to score."""

    is_main = True

    def __init__(self, max_seq_len: int = 64, wrong: str = "", drop_spaces: bool = False):
        self.max_seq_len = max_seq_len
        self.wrong = {ord(c) for c in wrong}
        self.drop_spaces = drop_spaces
        self.calls: list[list[list[int]]] = []

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text if not (self.drop_spaces and c == " ")]

    def score(self, seqs: list[list[int]]) -> list[TokenScores]:
        self.calls.append([list(s) for s in seqs])
        results = []
        for seq in seqs:
            assert 2 <= len(seq) <= self.max_seq_len + 1, len(seq)
            targets = seq[1:]
            results.append(
                TokenScores(
                    nll=np.array([fake_nll(i + 1, t) for i, t in enumerate(targets)]),
                    correct=np.array([t not in self.wrong for t in targets], dtype=bool),
                )
            )
        return results
