"""What an evaluation needs from a model: token ids for text, and per-token scores.

Two scorers implement it: `HFScorer` here (a Hugging Face model directory, one
process) and the distributed scorer of `megaeval.checkpoint_scorer` (a megatrain
checkpoint at any tp/pp). The evaluations in `wikitext` and `lambada` see only
this interface.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from megaeval.errors import EvalDataError


@dataclass
class TokenScores:
    """Scores of one sequence under teacher forcing; entry i is about target seq[i + 1]."""

    nll: np.ndarray  # float64, len(seq) - 1: -log p(seq[i+1] | seq[:i+1])
    correct: np.ndarray  # bool, len(seq) - 1: argmax of the prediction == seq[i+1]


class Scorer(Protocol):
    """A language model as the evaluations see it.

    `score` is collective for a distributed scorer: every process calls it with
    the same arguments in the same order. A sequence may be up to
    `max_seq_len + 1` tokens long: the model reads seq[:-1] and predicts seq[1:].
    Sequences in one call may differ in length.
    """

    max_seq_len: int  # longest input the model takes
    is_main: bool  # only the main process prints, shows progress and writes files

    def encode(self, text: str) -> list[int]: ...

    def score(self, seqs: list[list[int]]) -> list[TokenScores]: ...


class HFScorer:
    """A causal language model saved by Hugging Face `save_pretrained`, in this process.

    The tokenizer is `tokenizer.json` of the directory, read by `tokenizers`, or
    else whatever `transformers.AutoTokenizer` finds there.
    """

    is_main = True

    def __init__(self, model_dir: str | os.PathLike, device: str = "cpu", dtype="float32"):
        import torch

        try:
            import transformers
        except ImportError as e:
            raise ImportError(
                "--hf needs the transformers library: pip install 'megaeval[hf]'"
            ) from e

        model_dir = os.fspath(model_dir)
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise EvalDataError(f"{model_dir}: not a Hugging Face model directory (no config.json)")
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()

        config = self.model.config
        max_len = getattr(config, "n_positions", None) or getattr(
            config, "max_position_embeddings", None
        )
        if not max_len:
            raise EvalDataError(
                f"{model_dir}/config.json: neither n_positions nor max_position_embeddings is set"
            )
        self.max_seq_len = int(max_len)

        tokenizer_file = os.path.join(model_dir, "tokenizer.json")
        if os.path.isfile(tokenizer_file):
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(tokenizer_file)
            self._encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
        else:
            tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
            self._encode = lambda text: tokenizer.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        # No BOS/EOS: the paper scores the text's own tokens only.
        return list(self._encode(text))

    def score(self, seqs: list[list[int]]) -> list[TokenScores]:
        import torch

        if not seqs:
            return []
        lengths = [len(seq) - 1 for seq in seqs]  # model inputs are seq[:-1]
        if min(lengths) < 1 or max(lengths) > self.max_seq_len:
            raise ValueError(
                f"sequences must hold 2 to {self.max_seq_len + 1} tokens, got {min(lengths) + 1}"
                f" to {max(lengths) + 1}"
            )
        width = max(lengths)
        # Right padding: a causal model's outputs at real positions never see it.
        inputs = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
            inputs[row, :n] = torch.tensor(seq[:-1])
            mask[row, :n] = 1
        with torch.inference_mode():
            logits = self.model(
                input_ids=inputs.to(self.device), attention_mask=mask.to(self.device)
            ).logits
            # Half-precision logits are scored in float32; float64 models stay float64.
            if logits.dtype not in (torch.float32, torch.float64):
                logits = logits.float()
            results = []
            for row, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
                row_logits = logits[row, :n]
                targets = torch.tensor(seq[1:], device=row_logits.device)
                # -log_softmax at the target, without a vocabulary-sized copy of the logits.
                target_logits = row_logits.gather(1, targets[:, None])[:, 0]
                nll = torch.logsumexp(row_logits, dim=-1) - target_logits
                correct = row_logits.argmax(dim=-1) == targets
                results.append(
                    TokenScores(
                        nll=nll.to("cpu", torch.float64).numpy(),
                        correct=correct.cpu().numpy().astype(bool),
                    )
                )
        return results
