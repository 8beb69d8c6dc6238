"""Loss scaling for fp16 training (the paper trained with dynamic loss scaling).

`DynamicGradScaler` follows Megatron-LM: start at 2^32; on a step whose
gradients hold inf/nan, count one against the hysteresis and, once it is spent,
multiply the scale by the backoff factor (0.5), never below `min_scale`; after
`growth_interval` (1000) clean steps in a row, multiply it by the growth factor
(2) and refill the hysteresis.  The optimizer skips the step when inf/nan is
found; the scaler only decides the scale.  `ConstantGradScaler` keeps one scale.
"""

from dataclasses import asdict, dataclass, field


@dataclass
class ConstantGradScaler:
    initial_scale: float = 1.0

    def __post_init__(self):
        if self.initial_scale <= 0:
            raise ValueError(f"loss scale must be > 0, got {self.initial_scale}")
        self.scale = float(self.initial_scale)

    def update(self, found_inf: bool) -> None:
        """A constant scale does not move."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


@dataclass
class DynamicGradScaler:
    initial_scale: float = 2.0**32
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    scale: float = field(init=False)
    growth_tracker: int = field(init=False, default=0)
    hysteresis_tracker: int = field(init=False)

    def __post_init__(self):
        if not 0 < self.min_scale <= self.initial_scale:
            raise ValueError(
                f"loss scaler: need 0 < min_scale ({self.min_scale}) <= "
                f"initial_scale ({self.initial_scale})"
            )
        if self.growth_factor <= 1 or not 0 < self.backoff_factor < 1:
            raise ValueError(
                f"loss scaler: need growth_factor > 1 and 0 < backoff_factor < 1, got "
                f"{self.growth_factor} and {self.backoff_factor}"
            )
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError("loss scaler: growth_interval and hysteresis must be >= 1")
        self.scale = float(self.initial_scale)
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key in ("scale", "growth_tracker", "hysteresis_tracker"):
            setattr(self, key, type(getattr(self, key))(state[key]))
