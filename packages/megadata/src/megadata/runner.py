"""Run a stage's tasks on Dask workers, resumably, and count what they did.

A stage is a list of independent tasks (usually one per input partition).  A
task writes its outputs atomically and returns its counts; the runner then
records a marker `<stage dir>/_tasks/<task id>.json`.  A rerun skips tasks with
a marker, so a stage killed at any moment (even by kill -9) resumes without
losing or repeating work, and because every task is a pure function of its
inputs the result is the same bytes whatever the number of workers.  When all
tasks are done the stage writes `_DONE.json` with its totals.

Where the tasks run:
- `workers == 1` and no scheduler: in the calling process, one after the other;
- no scheduler: on a `distributed.LocalCluster` of `workers` processes (one thread
  each), started on first use and closed with the runner;
- `scheduler="tcp://host:8786"`: on that running Dask cluster.  Its workers must
  have megadata installed and see the corpus directory and the inputs at the same
  absolute paths (a shared filesystem), since tasks pass paths, not data.

A worker that dies mid-task (killed, out of memory) loses nothing: Dask runs its
tasks again elsewhere (up to `ALLOWED_FAILURES` deaths per task on the embedded
cluster; a real cluster's scheduler reads `distributed.scheduler.allowed-failures`
from its own config) and a task that raises is retried `RETRIES` times.  Running a
task twice is harmless because its outputs are written atomically and are the same
bytes each time.
"""

import ctypes
import functools
import importlib.util
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megacommon.files import atomic_write_json
from megacommon.progress import progress_bar

CONNECT_TIMEOUT_S = 10.0  # how long to wait for a --scheduler before giving up
RETRIES = 2  # re-runs of a task that raised (a flaky shared filesystem, say)
ALLOWED_FAILURES = 4  # deaths of a worker running a task before the task is given up
_LOCAL_CLUSTER_CONFIG = {
    "distributed.scheduler.allowed-failures": ALLOWED_FAILURES,
    # Dask starts its workers with MALLOC_TRIM_THRESHOLD_=65536, which turns off glibc's
    # adaptive mmap threshold: every large numpy array is then mapped and unmapped afresh,
    # page faults and all, and numpy-heavy stages (MinHash, n-gram hashes) take 2x the CPU.
    # None leaves the variable to the user's environment.
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
}
COUNTS = ("docs_in", "docs_out", "bytes_in", "bytes_out", "tokens")


@dataclass
class StageStats:
    stage: str
    docs_in: int = 0
    docs_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    tokens: int = 0
    seconds: float = 0.0  # wall time of the stage (of this run's tasks, on a resumed one)
    cpu_seconds: float = 0.0  # CPU time of its tasks, wherever they ran (resumed ones too)
    peak_rss_mb: float = 0.0  # the largest resident memory of a process that ran its tasks
    extra: dict = field(default_factory=dict)

    def add(self, counts: dict) -> None:
        for key in COUNTS:
            setattr(self, key, getattr(self, key) + int(counts.get(key, 0)))
        self.cpu_seconds += float(counts.get("cpu_seconds", 0.0))
        self.peak_rss_mb = max(self.peak_rss_mb, float(counts.get("peak_rss_mb", 0.0)))
        for key, value in counts.get("extra", {}).items():
            self.extra[key] = self.extra.get(key, 0) + value


@dataclass(frozen=True)
class Task:
    id: str  # unique in the stage; names the marker file
    args: tuple


class SchedulerError(ValueError):
    """`--scheduler ADDRESS` names no Dask cluster that can run megadata's tasks."""


def _connect(address: str):
    """A client of the cluster at `address`, once its workers are known to run megadata
    (a task a worker cannot unpickle would leave the run waiting forever)."""
    from distributed import Client

    try:
        client = Client(address, timeout=CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError, ValueError) as e:
        raise SchedulerError(
            f"--scheduler {address}: no Dask scheduler answered within {CONNECT_TIMEOUT_S:g} s "
            f"({e}); start one with `dask scheduler` (and workers with `dask worker "
            "ADDRESS`) or leave --scheduler out to use a local cluster"
        ) from None
    try:
        client.wait_for_workers(1, timeout=CONNECT_TIMEOUT_S)
        # A lambda travels by value: it runs even where megadata is not installed.
        found = client.run(lambda: importlib.util.find_spec("megadata") is not None)
    except (OSError, TimeoutError) as e:
        client.close()
        raise SchedulerError(
            f"--scheduler {address}: the scheduler has no workers ({e}); start some with "
            f"`dask worker {address}`"
        ) from None
    lacking = sorted(worker for worker, ok in found.items() if not ok)
    if lacking:
        client.close()
        raise SchedulerError(
            f"--scheduler {address}: megadata is not installed on the workers {lacking}"
        )
    return client


def _timed(fn: Callable, *args) -> dict:
    """The task's counts with the CPU time of its process while it ran (its threads'
    included: a library that works in threads is counted whole)."""
    start = time.process_time()
    counts = dict(fn(*args) or {})
    counts["cpu_seconds"] = time.process_time() - start
    counts["peak_rss_mb"] = _peak_rss_mb()
    return counts


def _peak_rss_mb() -> float:
    """The peak resident memory of this process so far: VmHWM on Linux (ru_maxrss would
    carry the peak of the process that started a worker over to the worker), else
    ru_maxrss (bytes on macOS)."""
    import resource

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 2**10, 1)  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def _worker_cpu_seconds() -> float:
    return time.process_time()


def _call(fn: Callable, *args) -> dict:
    """A task as a worker runs it."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one task per core already
    _keep_large_arrays_on_the_heap()
    return _timed(fn, *args)


@functools.cache
def _keep_large_arrays_on_the_heap() -> bool:
    """Undo, on a worker that a Dask nanny started with its MALLOC_TRIM_THRESHOLD_ (a real
    cluster's `dask worker`; the LocalCluster here starts without it), what that setting
    does to glibc: a fixed 128 kB mmap threshold, so that every numpy array above it is
    mapped, faulted in and unmapped afresh (MinHash and n-gram hashing then take 2x the
    CPU).  Arrays up to 32 MB come from the heap again, and up to 64 MB of free heap is
    kept.  True when glibc took the settings."""
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl): the variable meant nothing
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
    return bool(
        libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 64 << 20)
    )


class Runner:
    """Where every stage of a run executes its tasks (a cluster is started once: imports
    and worker start-up cost seconds)."""

    def __init__(self, workers: int = 2, progress: bool = True, scheduler: str | None = None):
        if workers < 1:
            raise ValueError(f"--workers must be >= 1, got {workers}")
        self.workers = workers
        self.progress = progress
        self.scheduler = scheduler
        self._cluster = None
        self._client = None

    def __enter__(self):
        if self.scheduler:  # an unreachable cluster is reported before any work starts
            self._dask()
        return self

    def __exit__(self, *exc):
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None

    def start(self) -> StageStats | None:
        """Start the cluster (or connect to it) now, once for the whole run, and return its
        cost as a row of its own (None when the tasks run in this process): the wall time,
        and the CPU time of this process and of the workers while they started."""
        if self.inline:
            return None
        wall, cpu = time.perf_counter(), time.process_time()
        client = self._dask()
        workers_cpu = sum(client.run(_worker_cpu_seconds).values()) if self._cluster else 0.0
        return StageStats(
            "cluster start",
            seconds=time.perf_counter() - wall,
            cpu_seconds=time.process_time() - cpu + workers_cpu,
            extra={"workers": len(client.scheduler_info()["workers"])},
        )

    @property
    def inline(self) -> bool:
        return self.scheduler is None and self.workers == 1

    def _dask(self):
        """The `distributed.Client`, connected on first use."""
        if self._client is not None:
            return self._client
        # Imported here: distributed takes half a second to import, which inline runs skip.
        import dask
        from distributed import Client, LocalCluster

        # Dask's loggers say INFO about every worker and key; the CLI's log handler would
        # print all of it.  Warnings (a worker restarted) still show.
        logging.getLogger("distributed").setLevel(logging.WARNING)

        if self.scheduler:
            self._client = _connect(self.scheduler)
            return self._client
        # The scheduler of a LocalCluster lives in this process and reads these settings now;
        # its nannies hand them to the workers they start.
        with dask.config.set(_LOCAL_CLUSTER_CONFIG):
            self._cluster = LocalCluster(
                n_workers=self.workers,
                threads_per_worker=1,
                processes=True,
                dashboard_address=None,
                # The scheduler's HTTP endpoints (not a dashboard) on any free port, not 8787.
                scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
                # A task's error reaches us as its exception; the cluster's own logs (a worker
                # restarted, a heartbeat lost while closing) would only be noise.
                silence_logs=logging.CRITICAL,
            )
        self._client = Client(self._cluster)
        return self._client

    def run(self, stage: str, stage_dir: Path, tasks: Sequence[Task], fn: Callable) -> StageStats:
        """Run `fn(*task.args) -> counts` for every task not already done; return the totals."""
        stage_dir = Path(stage_dir)
        done_file = stage_dir / "_DONE.json"
        if (finished := finished_stage(stage_dir)) is not None:
            return finished
        ids = [t.id for t in tasks]
        if len(set(ids)) != len(ids):
            raise ValueError(f"stage {stage}: task ids are not unique")
        markers = stage_dir / "_tasks"
        markers.mkdir(parents=True, exist_ok=True)
        stats = StageStats(stage)
        todo = []
        for t in tasks:
            counts = _read_marker(markers / f"{t.id}.json")
            if counts is not None:
                stats.add(counts)
            else:
                todo.append(t)
        start = time.perf_counter()
        bar = progress_bar(
            len(tasks), f"{stage:>9}", "part", enabled=self.progress,
            initial=len(tasks) - len(todo), leave=False,
        )  # fmt: skip
        with bar:
            for task, counts in self._results(stage, fn, todo):
                # Not synced to disk (a millisecond a task): a marker lost in a power cut
                # only has its task run again (the outputs it vouches for were synced).
                atomic_write_json(markers / f"{task.id}.json", counts, durable=False)
                stats.add(counts)
                bar.update(1)
                bar.set_postfix(docs=stats.docs_out, refresh=False)
        stats.seconds = time.perf_counter() - start
        atomic_write_json(done_file, asdict(stats))
        return stats

    def _results(self, stage: str, fn: Callable, tasks: Sequence[Task]):
        """(task, counts) as the tasks finish."""
        if self.inline or (self.scheduler is None and len(tasks) <= 1):
            for t in tasks:
                yield t, _timed(fn, *t.args)
            return
        if not tasks:
            return
        from distributed import as_completed

        client = self._dask()
        # A fresh key per submission: a rerun must run the task, never get a cached result.
        run_id = uuid.uuid4().hex[:8]
        # One `map` for the stage: the graph reaches the scheduler in one message, which
        # costs the calling process 40% less CPU a task than a `submit` each.
        if len({len(t.args) for t in tasks}) != 1:
            raise ValueError(f"stage {stage}: its tasks must take the same number of arguments")
        columns = [list(column) for column in zip(*(t.args for t in tasks), strict=True)]
        keys = [f"{stage}-{t.id}-{run_id}" for t in tasks]
        futures = dict(
            zip(
                client.map(_call, [fn] * len(tasks), *columns, key=keys, retries=RETRIES),
                tasks,
                strict=True,
            )
        )
        try:
            # Results gathered by as_completed in batches, not one round trip each.
            for future, counts in as_completed(futures, with_results=True):
                yield futures[future], counts
        except BaseException:
            client.cancel(list(futures))  # a task failed or we were stopped: stop the others
            raise


def finished_stage(stage_dir: Path) -> StageStats | None:
    """The totals of a stage whose tasks are all done (its `_DONE.json`), or None."""
    done_file = Path(stage_dir) / "_DONE.json"
    if not done_file.exists():
        return None
    return _stats_from(json.loads(done_file.read_text()))


def task_counts(stage_dir: Path, task_id: str) -> dict:
    """What a finished task of a stage returned (its marker)."""
    counts = _read_marker(Path(stage_dir) / "_tasks" / f"{task_id}.json")
    if counts is None:
        raise FileNotFoundError(f"{stage_dir}: task {task_id} has not finished")
    return counts


def _read_marker(path: Path) -> dict | None:
    """A task's counts from its marker, or None when it has none (or one that a power cut
    left empty or cut short: the task is run again)."""
    try:
        counts = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return counts if isinstance(counts, dict) else None


def _stats_from(d: dict) -> StageStats:
    return StageStats(**{k: v for k, v in d.items() if k in StageStats.__dataclass_fields__})


def format_table(rows: Sequence[StageStats]) -> str:
    """The per-stage table `megadata run` prints."""
    head = (
        f"{'stage':<14}{'docs in':>10}{'docs out':>10}{'MB in':>9}{'MB out':>9}"
        f"{'tokens':>12}{'sec':>8}{'cpu sec':>9}{'peak MB':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.stage:<14}{r.docs_in:>10}{r.docs_out:>10}{r.bytes_in / 1e6:>9.2f}"
            f"{r.bytes_out / 1e6:>9.2f}{r.tokens:>12}{r.seconds:>8.1f}{r.cpu_seconds:>9.1f}"
            f"{r.peak_rss_mb:>9.0f}"
        )
    return "\n".join(lines)
