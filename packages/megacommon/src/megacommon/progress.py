"""Progress that reads well where it goes: a tqdm bar on a terminal; elsewhere (a log file,
a batch job's output, CI) a plain line now and then, without carriage returns; nothing with
--no-progress.  megadata's stages and crawler, megatrain's and megaeval's long loops
(checkpoint reading, evaluations) use it.
"""

import sys
import time

from tqdm.auto import tqdm

# Seconds between plain lines; the last one comes at the end whatever the time.
LINE_EVERY_S = 30.0


def progress_bar(total: float, desc: str, unit: str, enabled: bool = True, **bar_options):
    """A tqdm bar when stderr is a terminal, else `PlainProgress`; silent unless `enabled`."""
    if not enabled:
        return tqdm(total=total, disable=True)
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=unit, **bar_options)
    return PlainProgress(total, desc, unit, initial=bar_options.get("initial", 0))


def duration(seconds: float) -> str:
    """12 s, 3 min 05 s, 2 h 07 min."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class PlainProgress:
    """The part of tqdm's interface our loops use, as periodic lines on stderr."""

    def __init__(
        self, total: float, desc: str, unit: str, every_s: float = LINE_EVERY_S, initial: float = 0
    ):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.n = self.initial = initial
        self.start = self.last = time.monotonic()
        self.closed = False

    def update(self, n: float = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.every_s:
            self._line()

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def _line(self) -> None:
        self.last = now = time.monotonic()
        elapsed = now - self.start
        done = f"{self.n:g}/{self.total:g} {self.unit}"
        if self.total:
            done += f" ({self.n / self.total:.0%})"
        eta = ""
        if self.initial < self.n < self.total:  # at this run's pace (resumed parts excluded)
            eta = f", ETA {duration(elapsed * (self.total - self.n) / (self.n - self.initial))}"
        print(f"{self.desc}: {done}, elapsed {duration(elapsed)}{eta}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
