"""Stop training when the loss stays nan/inf, instead of burning the allocation on garbage."""

import math
from dataclasses import dataclass


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class NonFiniteLossGuard:
    """Raise once the loss has been nan or inf for `max_consecutive` steps in a row.

    A single bad step can happen under fp16 (the loss scaler skips it); many in a
    row mean the run has diverged or the data is broken.
    """

    max_consecutive: int = 10
    streak: int = 0

    def __post_init__(self):
        if self.max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {self.max_consecutive}")

    def check(self, loss: float, step: int) -> None:
        if math.isfinite(loss):
            self.streak = 0
            return
        self.streak += 1
        if self.streak >= self.max_consecutive:
            raise NonFiniteLossError(
                f"stopping at step {step}: the loss was {loss} for {self.streak} steps in a row "
                f"(steps {step - self.streak + 1} to {step}). Lower the learning rate, use bf16 "
                "or a smaller initial loss scale, check the data, or resume from an earlier "
                "checkpoint."
            )
