"""Starting the worker processes: torch.distributed's elastic launcher, or the job we are in.

- Under torchrun (or any launcher that sets RANK and WORLD_SIZE) each process
  is already a worker and joins the job from the environment.
- Under Slurm with one task per GPU (`srun megatrain run ...`), SLURM_PROCID,
  SLURM_NTASKS and SLURM_LOCALID become RANK, WORLD_SIZE and LOCAL_RANK;
  MASTER_ADDR must name the first node (see scripts/slurm/).
- Otherwise `megatrain run` is the launcher: torch's elastic agent starts
  `nproc_per_node` workers here, and with --nnodes > 1 it meets the agents of
  the other nodes at --master-addr:--master-port (by --node-rank, within
  --rdzv-timeout seconds; the run id every node derives alike: `run_id`).

Signals.  torch's agent answers SIGINT/SIGTERM by raising SignalException and
closing the workers; but workers started as functions (`spawn`) wait after
returning until the agent has read their results, which it no longer does, so
the agent waited its 30 s shutdown timeout, killed them and exited 1 with a
traceback.  The launcher handles both signals itself instead (`_Signals`): the
first is passed on to the workers (which finish their iteration, agree through
an all-reduce, save and return) while the agent keeps collecting them normally,
and `launch` then raises `Interrupted`; a second (or a first before any worker
is up) kills the workers at once (checkpoints are complete before `latest` names
them, so the last one stands).  Under torchrun or Slurm the workers stop alike and
exit 130 (SIGINT) or 143 (SIGTERM) after saving (`megatrain run`).
"""

import contextlib
import dataclasses
import gc
import logging
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable

from torch.distributed import TCPStore
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
DEFAULT_RDZV_TIMEOUT = 600  # seconds a node waits for the others at --master-addr:--master-port
# Seconds the agent gives the workers between SIGTERM and SIGKILL when one failed (torch's
# default is 30): after a failure the others cannot finish a step, and a hung rank (the
# reason some fail) does not answer SIGTERM at all.
SHUTDOWN_TIMEOUT = 5
# Seconds node 0, which serves the rendezvous store, waits at the end for the other nodes to
# leave it (`NodeRendezvous.shutdown`).
LEAVE_TIMEOUT = 5


class LaunchError(RuntimeError):
    """The workers failed; the message holds the first failure's error."""


class Interrupted(LaunchError):
    """SIGINT or SIGTERM stopped the launch.

    `results`: the workers' {rank: result} when they saved and stopped at the first
    signal; None when a second signal killed them (`killed`), or they had not started or
    failed.
    """

    def __init__(
        self, signum: int, results: dict | None = None, killed: bool = False, elsewhere=False
    ):
        self.signum, self.results, self.killed = signum, results, killed
        self.name = signal.Signals(signum).name
        # The signal came to another node's launcher; this node's workers stopped with them.
        self.by = f"{self.name} on another node" if elsewhere else self.name
        super().__init__(
            f"{self.name} again: workers killed" if killed else f"stopped by {self.by}"
        )

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 130 for SIGINT, 143 SIGTERM."""
        return 128 + self.signum

    def describe(self, save_dir: str | None) -> str:
        """One line: the signal, the iteration and the checkpoint the run can resume from."""
        from megatrain.checkpoint.files import CheckpointError, find_checkpoint, read_meta

        stopped_at = stopped_iteration(self.results)
        saved = iteration = None
        if save_dir:
            with contextlib.suppress(CheckpointError):
                saved = find_checkpoint(save_dir)
                iteration = read_meta(saved)["iteration"]
        if self.killed:
            head = f"workers killed at the second {self.name}"
        elif self.results is None:
            head = f"stopped by {self.by} before the workers could save"
        else:
            stopped_at = stopped_at if stopped_at is not None else iteration
            head = f"stopped by {self.by} at iteration {stopped_at}"
            if saved is not None and iteration == stopped_at:
                return f"{head}; checkpoint saved in {save_dir}"
        if saved is None:
            return f"{head}; " + (
                f"no checkpoint in {save_dir}" if save_dir else "nothing saved (no --save)"
            )
        return f"{head}; the last complete checkpoint is {saved} (iteration {iteration})"


def stopped_iteration(results: dict | None) -> int | None:
    """The iteration the workers stopped at, from their `train_worker` results."""
    for result in (results or {}).values():
        if isinstance(result, dict) and result.get("stopped_at") is not None:
            return result["stopped_at"]
    return None


def agreed_signal(results: dict | None) -> int | None:
    """The signal the workers agreed to stop on (any node's), from their results."""
    for result in (results or {}).values():
        if isinstance(result, dict) and result.get("signum"):
            return result["signum"]
    return None


class RendezvousTimeout(LaunchError):
    """The other nodes did not all arrive at --master-addr:--master-port in time."""


def in_launched_job() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def adopt_slurm_environment() -> bool:
    """Translate one-task-per-GPU Slurm variables to torch's; False when not under such a job."""
    env = os.environ
    if in_launched_job() or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return False
    if "MASTER_ADDR" not in env:
        raise LaunchError(
            "running under Slurm with SLURM_NTASKS="
            f"{env['SLURM_NTASKS']} tasks, but MASTER_ADDR is not set; export it in the batch "
            "script, e.g. MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)"
        )
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
    env.setdefault("MASTER_PORT", "29500")
    return True


def run_id(master_addr: str, master_port: int) -> str:
    """The run id, the same on every node without being passed around: MEGATRAIN_RUN_ID if
    set, else the Slurm job's id, else the rendezvous address."""
    env = os.environ
    if env.get("MEGATRAIN_RUN_ID"):
        return env["MEGATRAIN_RUN_ID"]
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}"
    return f"{master_addr}:{master_port}"


class NodeRendezvous(StaticTCPRendezvous):
    """torch's static rendezvous (node ranks given, node 0 serves the store), waiting for the
    other nodes itself: within `timeout`, interruptible, and saying who came when they did not.

    Each node counts itself in and records its run id under its node rank; all wait until
    `world_size` nodes have, then check that the run ids (torch's keys live under it) agree.
    """

    BACKEND = "megatrain-static"
    POLL = 0.5  # seconds between looks at the count

    def get_backend(self) -> str:
        return self.BACKEND

    def next_rendezvous(self):
        if self._store is None:
            self._store = self._meet()
        return super().next_rendezvous()

    @property
    def address(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    def shutdown(self) -> bool:
        """Called by torch's launcher as each node's agent ends, after its exit barrier.  Node
        0 serves the store: it waits (at most LEAVE_TIMEOUT seconds) until every other node has
        said it is leaving, so that none is still reading the exit barrier's last key from a
        store already gone (which torch's agent logs as an error with a C++ trace, though the
        run went well).  The others say so and go."""
        if self._store is not None:
            key = "megatrain/rdzv/left"
            try:
                if self.rank != 0:
                    self._store.add(key, 1)
                else:
                    deadline = time.monotonic() + LEAVE_TIMEOUT
                    while self._store.add(key, 0) < self.world_size - 1:
                        if time.monotonic() > deadline:
                            break  # a node that died does not say so
                        time.sleep(0.05)
            except (RuntimeError, OSError):  # node 0's store gone already: nothing to tell
                pass
        return super().shutdown()

    def _meet(self) -> TCPStore:
        deadline = time.monotonic() + self.timeout.total_seconds()
        if self.rank == 0:
            try:
                store = TCPStore(
                    self.master_addr, self.master_port, self.world_size, True, self.timeout,
                    wait_for_workers=False, multi_tenant=True,
                )  # fmt: skip
            except RuntimeError as e:
                raise LaunchError(
                    f"node 0 cannot serve the rendezvous on port {self.master_port} ({e}); "
                    "is another job using it? Choose another --master-port"
                ) from e
        else:
            store = self._connect(deadline)
        key = "megatrain/rdzv"
        if store.add(f"{key}/claimed/{self.rank}", 1) > 1:
            raise LaunchError(
                f"two nodes were started with --node-rank {self.rank} at {self.address}"
            )
        store.set(f"{key}/run_id/{self.rank}", self.run_id)
        arrived = store.add(f"{key}/count", 1)
        while arrived < self.world_size:
            if time.monotonic() > deadline:
                seen = [r for r in range(self.world_size) if store.check([f"{key}/run_id/{r}"])]
                raise RendezvousTimeout(
                    f"waited {self.timeout.total_seconds():.0f} s at {self.address} for "
                    f"{self.world_size} nodes; {len(seen)} arrived (node ranks seen: "
                    f"{', '.join(map(str, seen))}). Start the other nodes with --master-addr "
                    f"{self.master_addr} --master-port {self.master_port}, or raise --rdzv-timeout"
                )
            time.sleep(self.POLL)
            arrived = store.add(f"{key}/count", 0)
        for r in range(self.world_size):
            other = store.get(f"{key}/run_id/{r}").decode()
            if other != self.run_id:
                raise LaunchError(
                    f"node {r} has run id {other!r}, node {self.rank} {self.run_id!r}: set the "
                    "same MEGATRAIN_RUN_ID on every node, or none"
                )
        return store

    def _connect(self, deadline: float) -> TCPStore:
        """A client of node 0's store, once its port answers (probed from Python, so that a
        signal is heard and no C++ connection errors are printed while node 0 is not up)."""
        import socket

        while True:
            try:
                socket.create_connection((self.master_addr, self.master_port), timeout=2).close()
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RendezvousTimeout(
                        f"waited {self.timeout.total_seconds():.0f} s at {self.address} for "
                        f"{self.world_size} nodes; node 0 never answered there ({e}). Start "
                        f"node 0 with --node-rank 0 --master-addr {self.master_addr} "
                        f"--master-port {self.master_port}, or raise --rdzv-timeout"
                    ) from e
                time.sleep(self.POLL)
        return TCPStore(self.master_addr, self.master_port, self.world_size, False, self.timeout)


def _node_rendezvous(params: RendezvousParameters) -> NodeRendezvous:
    host, port = params.endpoint.rsplit(":", 1)
    return NodeRendezvous(
        host, int(port), int(params.config["rank"]), params.max_nodes, params.run_id,
        int(params.config["timeout"]),
    )  # fmt: skip


class _Signals:
    """SIGINT/SIGTERM while the agent runs: the first goes on to the workers (and is kept in
    `signum`), a second, or a first before any worker is up, kills them and raises `_Abort`
    into the agent, which then closes down."""

    def __init__(self):
        self.signum: int | None = None
        self.killed = False

    def __enter__(self):
        # Only the main thread may set handlers; elsewhere (torch's agent sets none there
        # either) the process's own handling stays.
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self.handle) for s in STOP_SIGNALS}
        else:
            self._previous = {}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        # The workers are this process's children (the agent runs here, in the main thread).
        workers = multiprocessing.active_children()
        if self.signum is None:
            self.signum = signum
            if workers:
                _send(workers, signum)
                return
        self.killed = bool(workers)
        _send(workers, signal.SIGKILL)
        for worker in workers:  # reaped here, the agent finds them gone and closes at once
            worker.join(5)
        raise _Abort


class _Abort(Exception):
    """Raised by `_Signals` to end the agent's run."""


def _send(workers: list, signum: int) -> None:
    for worker in workers:
        _send_pid(worker.pid, signum)


def _send_pid(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


@contextlib.contextmanager
def _signals_left_to(watch: _Signals, options: dict):
    """Keep torch's agent from answering SIGINT/SIGTERM itself (it would raise SignalException
    in the middle of collecting the workers' results)."""
    if "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)}:  # torch >= 2.9
        options["signals_to_handle"] = "SIGHUP,SIGQUIT"
        previous = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")  # which torch sets from it
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
            else:
                os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = previous
        return
    # Older torch installs its handler for every signal as the workers start: make it ours.
    from torch.distributed.elastic.multiprocessing import api

    original = api._terminate_process_handler

    def handler(signum, frame):
        (watch.handle if signum in STOP_SIGNALS else original)(signum, frame)

    api._terminate_process_handler = handler
    try:
        yield
    finally:
        api._terminate_process_handler = original


class _OneLinePerFailedWorker(logging.Filter):
    """torch's agent logs a failed worker as a traceback of its own internals: say which
    worker ended and how, in one line.  It then stops the others with SIGTERM and waits 30 s
    before SIGKILL; a hung rank (why the others failed, often) does not answer SIGTERM, so
    each one it stops is killed after SHUTDOWN_TIMEOUT seconds instead."""

    FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
    TERMINATING = re.compile(r"Terminating process (\d+) via signal SIGTERM")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if found := self.FAILED.search(message):
            code, local_rank, pid = map(int, found.groups())
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            print(f"megatrain: worker local rank {local_rank} (pid {pid}) ended: {how}",
                  file=sys.stderr, flush=True)  # fmt: skip
        elif found := self.TERMINATING.search(message):
            timer = threading.Timer(SHUTDOWN_TIMEOUT, _kill_if_still_ours, (int(found[1]),))
            timer.daemon = True
            timer.start()
        return False


def _kill_if_still_ours(pid: int) -> None:
    if any(worker.pid == pid for worker in multiprocessing.active_children()):
        _send_pid(pid, signal.SIGKILL)


@contextlib.contextmanager
def _worker_failures_in_one_line():
    loggers = [logging.getLogger(n) for n in (
        "torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"
    )]  # fmt: skip
    one_line = _OneLinePerFailedWorker()
    for logger in loggers:
        logger.addFilter(one_line)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(one_line)


def _worker_entry(entrypoint: Callable, *args):
    """One worker: `entrypoint(*args)`; then its objects are frozen, which spares the exit
    of the process the collections over all of torch's objects (seconds on a busy CPU, which
    the launcher would wait)."""
    result = entrypoint(*args)
    gc.freeze()
    return result


def launch(
    entrypoint: Callable,
    args: tuple,
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    max_restarts: int = 0,
    rdzv_timeout: int = DEFAULT_RDZV_TIMEOUT,
) -> dict:
    """Run `entrypoint(*args)` in nproc_per_node workers on this node; {global rank: result}.

    Raises `Interrupted` after SIGINT/SIGTERM (see the module's docstring), `RendezvousTimeout`
    when the other nodes did not all arrive within `rdzv_timeout` seconds, `LaunchError` when
    a worker failed."""
    if nnodes == 1:  # as `torchrun --standalone`: a rendezvous on a free local port
        rdzv = {"rdzv_backend": "c10d", "rdzv_endpoint": "127.0.0.1:0", "rdzv_configs": {}}
        rid = os.environ.get("MEGATRAIN_RUN_ID") or str(uuid.uuid4())
    else:
        rendezvous_handler_registry.register(NodeRendezvous.BACKEND, _node_rendezvous)
        rdzv = {
            "rdzv_backend": NodeRendezvous.BACKEND,
            "rdzv_endpoint": f"{master_addr}:{master_port}",
            "rdzv_configs": {"rank": node_rank, "timeout": rdzv_timeout},
        }
        rid = run_id(master_addr, master_port)
    watch = _Signals()
    options = {}
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:  # newer torch
        options["shutdown_timeout"] = SHUTDOWN_TIMEOUT
    with watch, _signals_left_to(watch, options), _worker_failures_in_one_line():
        config = LaunchConfig(
            min_nodes=nnodes,
            max_nodes=nnodes,
            nproc_per_node=nproc_per_node,
            run_id=rid,
            max_restarts=max_restarts,
            monitor_interval=0.5,
            start_method="spawn",
            **rdzv,
            **options,
        )
        try:
            results = elastic_launch(config, _worker_entry)(entrypoint, *args)
        except _Abort:
            raise Interrupted(watch.signum, killed=watch.killed) from None
        except ChildFailedError as e:
            if watch.signum is not None:  # a worker did not get as far as its signal handler
                raise Interrupted(watch.signum) from None
            rank, failure = e.get_first_failure()
            message = failure.message
            if isinstance(message, dict):
                message = message.get("message", message)
            raise LaunchError(f"worker rank {rank} failed: {message}") from e
    if watch.signum is not None:
        raise Interrupted(watch.signum, results)
    # A signal to another node's launcher: every rank agreed on it, saved and stopped; this
    # node ends as that one does, not as a finished run.
    if (signum := agreed_signal(results)) is not None:
        raise Interrupted(signum, results, elsewhere=True)
    return results


def train_worker(config_dict: dict) -> dict:
    """What each worker of `megatrain run` runs: the training loop on the config (a dict,
    which pickles to the spawned processes); imported there, not in the launching process.

    Every rank returns the signal its run stopped on (agreed by all ranks, whichever node got
    it) and the iteration, so that every node's launcher can say so; rank 0 its history too."""
    from megatrain.config import Config
    from megatrain.run.loop import StopSignal, train

    stop = StopSignal()
    history = train(Config.from_dict(config_dict), stop)
    return {"history": history, "signum": stop.signum, "stopped_at": stop.at}


def run_workers(entrypoint: Callable, args: tuple, nproc: int) -> dict:
    """`entrypoint(*args)` on `nproc` local workers; {rank: result}.

    For tools that are not training (generation, evaluation, conversion).  One
    worker runs in this process, in a one-rank process group of its own, which
    saves a process start; more go through `launch`.
    """
    if nproc > 1:
        return launch(entrypoint, args, nproc_per_node=nproc)
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    saved = {k: os.environ.get(k) for k in [*env, "MASTER_PORT"]}
    os.environ.update(env, MASTER_PORT=str(port))
    try:
        return {0: entrypoint(*args)}
    finally:
        from megacore import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
