"""Run a stage's tasks in worker processes, resumably, and count what they did.

A stage is a list of independent tasks (usually one per input partition).  A
task writes its outputs atomically and returns its counts; the runner then
records a marker `<stage dir>/_tasks/<task id>.json`.  A rerun skips tasks with
a marker, so a stage killed at any moment (even by kill -9) resumes without
losing or repeating work, and because every task is a pure function of its
inputs the result is the same bytes whatever the number of workers.  When all
tasks are done the stage writes `_DONE.json` with its totals.
"""

import json
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from megadata.documents import atomic_write_json

COUNTS = ("docs_in", "docs_out", "bytes_in", "bytes_out", "tokens")


@dataclass
class StageStats:
    stage: str
    docs_in: int = 0
    docs_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    tokens: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def add(self, counts: dict) -> None:
        for key in COUNTS:
            setattr(self, key, getattr(self, key) + int(counts.get(key, 0)))
        for key, value in counts.get("extra", {}).items():
            self.extra[key] = self.extra.get(key, 0) + value


@dataclass(frozen=True)
class Task:
    id: str  # unique in the stage; names the marker file
    args: tuple


def _init_worker() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already


class Runner:
    """Worker processes shared by every stage of a run (started once: imports cost seconds)."""

    def __init__(self, workers: int = 2, progress: bool = True):
        if workers < 1:
            raise ValueError(f"--workers must be >= 1, got {workers}")
        self.workers = workers
        self.progress = progress
        self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
            )
        return self._pool

    def run(self, stage: str, stage_dir: Path, tasks: Sequence[Task], fn: Callable) -> StageStats:
        """Run `fn(*task.args) -> counts` for every task not already done; return the totals."""
        stage_dir = Path(stage_dir)
        done_file = stage_dir / "_DONE.json"
        if done_file.exists():
            return _stats_from(json.loads(done_file.read_text()))
        ids = [t.id for t in tasks]
        if len(set(ids)) != len(ids):
            raise ValueError(f"stage {stage}: task ids are not unique")
        markers = stage_dir / "_tasks"
        markers.mkdir(parents=True, exist_ok=True)
        stats = StageStats(stage)
        todo = []
        for t in tasks:
            marker = markers / f"{t.id}.json"
            if marker.exists():
                stats.add(json.loads(marker.read_text()))
            else:
                todo.append(t)
        start = time.perf_counter()
        bar = tqdm(
            total=len(tasks),
            initial=len(tasks) - len(todo),
            desc=f"{stage:>9}",
            unit="part",
            disable=not self.progress,
            leave=False,
        )
        with bar:
            for task, counts in self._results(fn, todo):
                atomic_write_json(markers / f"{task.id}.json", counts)
                stats.add(counts)
                bar.update(1)
                bar.set_postfix(docs=stats.docs_out, refresh=False)
        stats.seconds = time.perf_counter() - start
        atomic_write_json(done_file, asdict(stats))
        return stats

    def _results(self, fn, tasks):
        if self.workers == 1 or len(tasks) <= 1:
            for t in tasks:
                yield t, fn(*t.args)
            return
        pool = self._executor()
        futures = {pool.submit(fn, *t.args): t for t in tasks}
        for future in as_completed(futures):
            yield futures[future], future.result()


def _stats_from(d: dict) -> StageStats:
    return StageStats(**{k: v for k, v in d.items() if k in StageStats.__dataclass_fields__})


def format_table(rows: Sequence[StageStats]) -> str:
    """The per-stage table `megadata run` prints."""
    head = (
        f"{'stage':<10}{'docs in':>10}{'docs out':>10}{'MB in':>9}{'MB out':>9}"
        f"{'tokens':>12}{'sec':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.stage:<10}{r.docs_in:>10}{r.docs_out:>10}{r.bytes_in / 1e6:>9.2f}"
            f"{r.bytes_out / 1e6:>9.2f}{r.tokens:>12}{r.seconds:>8.1f}"
        )
    return "\n".join(lines)
