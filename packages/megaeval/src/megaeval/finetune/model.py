"""BERT with a fine-tuning head, as Megatron's tasks built it (on megatrain's `BertModel`).

- "classify" (MNLI 3 classes, QQP 2): dropout, then a linear layer on the pooled [CLS].
- "choice" (RACE): each example is 4 sequences; dropout and a linear layer to one score per
  sequence on the pooled [CLS], the 4 scores of an example softmaxed together.
- "span" (SQuAD): a linear layer to a start and an end logit on every position's final
  hidden state.

The encoder is BERT's (without its pretraining heads, which a pretraining checkpoint then
does not load); the head, named `task_head`, is drawn from its own generator (`seed - 6`)
and replicated over TP ranks: it runs on the gathered hidden states every TP rank holds
the same, so its gradients need no reduction.
"""

from functools import partial

import torch
import torch.nn.functional as F

from megatrain.models.bert import BertModel, replicated_linear
from megatrain.models.layout import build_chunks
from megatrain.models.transformer_config import TransformerConfig

HEADS = ("classify", "choice", "span")
CHOICES = 4  # RACE's options per question


class TaskModel(BertModel):
    """`forward(tokens, token_types, padding_mask, labels=None)`, inputs [n, s] (n sequences;
    for "choice" n = 4 x examples).  A stage before the last returns its activations.  The
    last returns the logits without `labels` ([examples, classes]; "span": [n, s, 2]), and
    with them a dict of scalar tensors: "loss" (mean cross entropy; "span": the mean of the
    start and end losses) and "accuracy" ("span": both ends right)."""

    PRETRAINING_HEADS = False

    def __init__(self, cfg: TransformerConfig, *args, head: str, num_classes: int = 2, **kwargs):
        if head not in HEADS:
            raise ValueError(f"TaskModel: head must be one of {HEADS}, not {head!r}")
        super().__init__(cfg, *args, **kwargs)
        self.head = head
        if not self.post_process:
            return
        outputs = {"classify": num_classes, "choice": 1, "span": 2}[head]
        seed = kwargs.get("seed", 1234)
        device, dtype = kwargs.get("device"), kwargs.get("dtype", torch.float32)
        self.task_head = replicated_linear(
            cfg, outputs, cfg.hidden_size, seed - 6, device, dtype, kwargs.get("initialize", True)
        )

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.config.hidden_dropout, self.training)

    def forward(self, tokens, token_types, padding_mask, labels: torch.Tensor | None = None):
        out = self.encode(tokens, token_types, padding_mask)
        if not self.post_process:
            return out
        hidden, pooled = out
        if self.head == "span":
            logits = self.task_head(hidden).transpose(0, 1)  # [n, s, 2]
        else:
            logits = self.task_head(self._dropout(pooled))
            if self.head == "choice":
                logits = logits.view(-1, CHOICES)
        if labels is None:
            return logits
        labels = labels.to(logits.device)
        if self.head == "span":  # labels [n, 2]: start and end positions
            start, end = logits.float().unbind(-1)
            loss = (F.cross_entropy(start, labels[:, 0]) + F.cross_entropy(end, labels[:, 1])) / 2
            right = (start.argmax(-1) == labels[:, 0]) & (end.argmax(-1) == labels[:, 1])
        else:
            loss = F.cross_entropy(logits.float(), labels)
            right = logits.argmax(-1) == labels
        return {"loss": loss, "accuracy": right.float().mean()}


def build_task_chunks(
    cfg: TransformerConfig, head: str, num_classes: int, seed: int = 1234, **placement
) -> list[TaskModel]:
    """This rank's chunks of BERT with the task's head (see `layout.build_chunks`), as built:
    `prepare_training` parallelizes them."""
    model = partial(TaskModel, head=head, num_classes=num_classes)
    return build_chunks(model, cfg, seed, **placement)


__all__ = ["CHOICES", "HEADS", "TaskModel", "build_task_chunks"]
