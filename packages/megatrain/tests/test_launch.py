"""`megatrain run` as a launcher: SIGINT/SIGTERM save, stop and exit 130/143 with one line
(also under torchrun), a second signal kills at once and leaves the last checkpoint whole;
nodes meet on a run id they share (two nodes on loopback train as one node of 4, and Ctrl-C to
one stops both, each saying so), and a node left alone gives up after --rdzv-timeout, saying
who came."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from megatrain.checkpoint.files import find_checkpoint, read_meta
from megatrain.cli import main
from megatrain.run import launch
from megatrain.testing import random_documents, write_corpus

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "pipelines" / "models" / "gpt2-tiny.toml"
VOCAB = 200
# The launcher's exit after the workers' last line ("megatrain: done"): their return and
# exit, the agent's next look (0.5 s) and its own exit: 1-3 s (3.0 s at a load average of 20
# on 2 cores), where torch's agent left to itself waited its 30 s shutdown timeout.  Timed
# from that line, not from the save: the loss plot between them is the run's work (8.9 s at
# that load, which took the exit 11.9 s after the save), not the launcher's.
EXIT_AFTER_DONE_S = 8.0
# Variables that would make a process join a job, or name the run, instead of launching.
JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "MEGATRAIN_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS")  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(1)

    def docs(n):
        return random_documents(rng, n, VOCAB, 40, 120)

    root = tmp_path_factory.mktemp("corpus")
    return write_corpus(
        root, {"train": [docs(40), docs(40)], "valid": [docs(20)]}, vocab_size=VOCAB
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A command in a session of its own (its process group: what a terminal's Ctrl-C hits),
    its output (stdout and stderr) read as it comes, each line with the time it came."""

    def __init__(self, command: list[str]):
        env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
        self.popen = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.popen.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float = 240) -> tuple[float, str]:
        """The first line matching `pattern` and when it came."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for when, line in list(self.lines):
                if re.search(pattern, line):
                    return when, line
            if self.popen.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}:\n{self.output[-4000:]}")

    def finish(self, timeout: float = 120) -> tuple[int, float]:
        """Exit code and the time of the exit."""
        returncode = self.popen.wait(timeout)
        ended = time.monotonic()
        self._reader.join(10)
        return returncode, ended

    def kill(self):
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(30)


@pytest.fixture
def procs():
    started = []
    yield lambda command: started.append(Proc(command)) or started[-1]
    for p in started:
        p.kill()


def _run(corpus, out, *extra):
    return [
        sys.executable, "-m", "megatrain.cli", "run", "--config", str(TINY),
        f"data.corpus={str(corpus)!r}", f"training.output_dir={str(out)!r}",
        "training.seq_length=32", "training.micro_batch_size=2", "optimizer.lr_warmup_iters=1",
        "training.eval_interval=100000", "training.eval_iters=1", "logging.log_interval=1",
        *extra,
    ]  # fmt: skip


LONG = ("training.train_iters=100000",)


def _one_launcher_line(proc: Proc) -> str:
    """The launcher's own output: one line, no traceback, no warning of torch's agent."""
    ours = [line for _, line in proc.lines if line.startswith("megatrain run:")]
    assert len(ours) == 1, proc.output[-4000:]
    for _, line in proc.lines:
        assert not re.match(r"[WE]\d{4} ", line), proc.output[-4000:]  # torch's log lines
        for word in ("Traceback", "SignalException", "forcefully", "KeyboardInterrupt"):
            assert word not in line, proc.output[-4000:]
    return ours[0]


def _latest_iteration(ckpt: Path) -> int:
    """`latest` names a complete iteration (every file there, of its size)."""
    return read_meta(find_checkpoint(ckpt))["iteration"]


def test_ctrl_c_to_the_group_saves_stops_and_a_second_kills(corpus, tmp_path, procs):
    """Ctrl-C in a terminal (SIGINT to every process of the group): every rank finishes its
    iteration and saves, the launcher says so in one line and exits 130, promptly.  Resumed,
    a second Ctrl-C kills the workers at once; `latest` still names a whole checkpoint."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run = procs(_run(corpus, out, *LONG, "--nproc-per-node", "2", "--save", str(ckpt)))
    run.wait_for(r"^iteration 2/")
    os.killpg(run.popen.pid, signal.SIGINT)
    run.wait_for(r"^megatrain: saved ")
    done, _ = run.wait_for(r"^megatrain: done")
    returncode, ended = run.finish()
    line = _one_launcher_line(run)
    assert returncode == 130, run.output[-4000:]
    stopped = int(re.search(r"stopped by SIGINT at iteration (\d+)", run.output).group(1))
    assert line == (
        f"megatrain run: stopped by SIGINT at iteration {stopped}; checkpoint saved in {ckpt}"
    )
    assert ended - done < EXIT_AFTER_DONE_S, f"exited {ended - done:.1f} s after the workers"
    assert _latest_iteration(ckpt) == stopped >= 2

    # Resume, saving every iteration, and press Ctrl-C twice: killed, wherever the save was.
    again = procs(_run(corpus, out, *LONG, "--nproc-per-node", "2", "--load", str(ckpt),
                       "--save", str(ckpt), "checkpoint.save_interval=1"))  # fmt: skip
    again.wait_for(rf"resumed from .* at iteration {stopped}$")
    again.wait_for(rf"^iteration {stopped + 2}/")
    os.killpg(again.popen.pid, signal.SIGINT)
    time.sleep(0.2)
    os.killpg(again.popen.pid, signal.SIGINT)
    second = time.monotonic()
    returncode, ended = again.finish()
    line = _one_launcher_line(again)
    assert returncode == 130, again.output[-4000:]
    assert ended - second < 5, f"exited {ended - second:.1f} s after the second SIGINT"
    iteration = _latest_iteration(ckpt)
    assert iteration >= stopped + 1
    assert line == (
        "megatrain run: workers killed at the second SIGINT; the last complete checkpoint is "
        f"{ckpt / f'iter_{iteration:07d}'} (iteration {iteration})"
    )


def test_sigterm_to_the_launcher_alone_reaches_the_workers(corpus, tmp_path, procs):
    """A scheduler's SIGTERM to the launcher only: passed on to the workers, which save."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run = procs(_run(corpus, out, *LONG, "parallel.tensor_model_parallel_size=2",
                     "--save", str(ckpt)))  # fmt: skip
    run.wait_for(r"^iteration 2/")
    os.kill(run.popen.pid, signal.SIGTERM)
    run.wait_for(r"^megatrain: saved ")
    done, _ = run.wait_for(r"^megatrain: done")
    returncode, ended = run.finish()
    line = _one_launcher_line(run)
    assert returncode == 143, run.output[-4000:]
    iteration = _latest_iteration(ckpt)
    assert line == (
        f"megatrain run: stopped by SIGTERM at iteration {iteration}; checkpoint saved in {ckpt}"
    )
    assert ended - done < EXIT_AFTER_DONE_S, f"exited {ended - done:.1f} s after the workers"


def test_worker_under_torchrun_exits_143_after_saving(corpus, tmp_path, procs):
    """Under torchrun each worker is its own process: SIGTERM to one of them stops both ranks
    at the same iteration (the signal is agreed on), both save once and exit 143."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    command = _run(corpus, out, *LONG, "--save", str(ckpt))
    command[1:4] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m", "megatrain.cli", "run"]  # fmt: skip
    run = procs(command)
    run.wait_for(r"^iteration 2/")
    workers = subprocess.run(
        ["pgrep", "-P", str(run.popen.pid)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[-1]), signal.SIGTERM)
    run.finish()
    iteration = _latest_iteration(ckpt)
    # Rank 0 names the signal even when rank 1 got it; torchrun reports the exit status.
    assert f"megatrain: stopped by SIGTERM at iteration {iteration}" in run.output
    assert re.search(r"exitcode\s*:\s*143\b", run.output), run.output[-4000:]
    assert run.output.count("megatrain: saved ") == 1


def test_run_id_is_shared_by_every_node(monkeypatch):
    for key in ("MEGATRAIN_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    assert launch.run_id("10.0.0.1", 29500) == "10.0.0.1:29500"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert launch.run_id("10.0.0.1", 29500) == "slurm-4242"
    monkeypatch.setenv("MEGATRAIN_RUN_ID", "mine")
    assert launch.run_id("10.0.0.1", 29500) == "mine"
    result = CliRunner().invoke(main, ["run", "-h"])
    assert "--rdzv-timeout" in result.output and "600" in result.output


def test_slurm_script_starts_one_launcher_per_node():
    """One `megatrain run` per node, its rank from Slurm, node 0 as master; the run id then
    comes from SLURM_JOB_ID, which srun passes to every task."""
    for script in (ROOT / "scripts" / "slurm").glob("*.sbatch"):
        text = script.read_text()
        assert "#SBATCH --ntasks-per-node=1" in text, script
        assert "--nnodes $SLURM_JOB_NUM_NODES --node-rank \\$SLURM_NODEID" in text, script
        assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
        assert "--master-addr $MASTER_ADDR --master-port $MASTER_PORT" in text, script
        assert "MEGATRAIN_RUN_ID" not in text, script  # SLURM_JOB_ID names the run


def _node(corpus, out, rank, port, *extra):
    """Node `rank` of 2, of 2 ranks each, meeting at 127.0.0.1:`port`."""
    return _run(corpus, out, *extra, "--nproc-per-node", "2", "--nnodes", "2", "--node-rank",
                str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port))  # fmt: skip


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()]


def test_two_nodes_on_loopback_train_as_one_node_and_stop_together(corpus, tmp_path, procs):
    """Two launchers, --nnodes 2, meeting at 127.0.0.1 (nothing else set), train the same
    losses as one node of 4 ranks.  Ctrl-C to node 0 alone: every rank of both nodes saves the
    same checkpoint and stops, and each launcher exits 130 with one line saying why."""
    port, ckpt = _free_port(), tmp_path / "ckpt"
    nodes = [procs(_node(corpus, tmp_path / f"node{r}", r, port, *LONG, "--save", str(ckpt)))
             for r in (0, 1)]  # fmt: skip
    one = procs(_run(corpus, tmp_path / "one", "training.train_iters=3", "--nproc-per-node", "4"))
    nodes[0].wait_for(r"^iteration 3/")
    os.killpg(nodes[0].popen.pid, signal.SIGINT)
    for p in nodes:
        assert p.finish(300)[0] == 130, p.output[-4000:]
    assert one.finish(300)[0] == 0, one.output[-4000:]
    assert "4 ranks = tp 1 x pp 1 x dp 4" in nodes[0].output
    stopped = _latest_iteration(ckpt)
    assert stopped >= 3 and nodes[0].output.count("megatrain: saved ") == 1
    assert _one_launcher_line(nodes[0]) == (
        f"megatrain run: stopped by SIGINT at iteration {stopped}; checkpoint saved in {ckpt}"
    )
    assert _one_launcher_line(nodes[1]) == (
        f"megatrain run: stopped by SIGINT on another node at iteration {stopped}; checkpoint "
        f"saved in {ckpt}"
    )
    two = _losses(tmp_path / "node0")
    assert len(two) == stopped and two[:3] == _losses(tmp_path / "one")


def test_a_node_left_alone_gives_up_after_rdzv_timeout(corpus, tmp_path, procs):
    """Node 0 alone waits --rdzv-timeout seconds for the others and says who came; node 1
    alone, that node 0 never answered."""
    ports = _free_port(), _free_port()
    alone = [
        procs(_node(corpus, tmp_path / f"alone{r}", r, port, *LONG, "--rdzv-timeout", "5"))
        for r, port in zip((0, 1), ports, strict=True)
    ]
    started = time.monotonic()
    results = [p.finish(60) for p in alone]
    for p, (returncode, ended) in zip(alone, results, strict=True):
        assert returncode == 1, p.output[-4000:]
        assert 5 <= ended - started < 30, f"gave up after {ended - started:.1f} s"
    assert _one_launcher_line(alone[0]) == (
        f"megatrain run: waited 5 s at 127.0.0.1:{ports[0]} for 2 nodes; 1 arrived (node ranks "
        f"seen: 0). Start the other nodes with --master-addr 127.0.0.1 --master-port "
        f"{ports[0]}, or raise --rdzv-timeout"
    )
    line = _one_launcher_line(alone[1])
    assert line.startswith(
        f"megatrain run: waited 5 s at 127.0.0.1:{ports[1]} for 2 nodes; node 0 never answered"
    ), line


def _last_losses(out: Path) -> dict[int, float]:
    """Loss per iteration as logged; an iteration redone after a restart counts as its last."""
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records if "loss" in r}


def _workers(proc: Proc) -> list[int]:
    """The launcher's worker processes (not multiprocessing's resource tracker), in the order
    they started, which is rank order."""
    found = subprocess.run(["pgrep", "-P", str(proc.popen.pid)], capture_output=True, text=True)
    pids = sorted(int(pid) for pid in found.stdout.split())
    return [p for p in pids if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(corpus, tmp_path, procs):
    """--max-restarts: a worker SIGKILLed mid-run is restarted with the others by the elastic
    agent, all resume from the last checkpoint, and every loss equals an uninterrupted run's,
    bitwise."""
    ckpt = tmp_path / "ckpt"
    steps = ("training.train_iters=40", "checkpoint.save_interval=4", "--nproc-per-node", "2")
    run = procs(_run(corpus, tmp_path / "run", *steps, "--max-restarts", "1", "--save", str(ckpt)))
    run.wait_for(r"^megatrain: saved .*iter_0000004$")
    run.wait_for(r"^iteration 6/")
    workers = _workers(run)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGKILL)
    assert run.finish(300)[0] == 0, run.output[-4000:]
    resumed = re.search(r"megatrain: restart 1 after a failed worker: resumed from \S+ at "
                        r"iteration (\d+)$", run.output, re.MULTILINE)  # fmt: skip
    assert resumed and int(resumed.group(1)) >= 4, run.output[-4000:]
    reference = procs(_run(corpus, tmp_path / "reference", *steps))
    assert reference.finish(300)[0] == 0, reference.output[-4000:]
    got, want = _last_losses(tmp_path / "run"), _last_losses(tmp_path / "reference")
    assert len(want) == 40 and got == want


def test_a_hung_rank_ends_the_job_within_the_collective_timeout(corpus, tmp_path, procs):
    """A rank that stops answering (SIGSTOP) leaves the other waiting in a collective: after
    parallel.collective_timeout the job ends, in one line naming the waiting rank, the
    operation and the rank that never arrived."""
    run = procs(_run(corpus, tmp_path / "run", *LONG, "--nproc-per-node", "2",
                     "parallel.collective_timeout=4"))  # fmt: skip
    run.wait_for(r"^iteration 2/")
    workers = _workers(run)
    assert len(workers) == 2, workers
    os.kill(workers[-1], signal.SIGSTOP)  # rank 1: the workers start in rank order
    stopped = time.monotonic()
    returncode, ended = run.finish(120)
    assert returncode == 1, run.output[-4000:]
    # Two parts, each timed from the line that ends the one before and held apart from what
    # it would take otherwise.  Rank 0 gives up after the 4 s collective timeout (not before:
    # the job outlives it), not the 600 s default, and exits as a failed worker does (9.3 s
    # after the timeout at a load average of 20 on 2 cores: hence 30 s of slack).  Then the
    # hung rank is killed after launch.SHUTDOWN_TIMEOUT, not torch's agent's 30 s.
    failed, _ = run.wait_for(r"^megatrain: worker local rank 0 \(pid")  # no torch traceback
    assert ended - stopped >= 4, f"ended after {ended - stopped:.1f} s"
    assert failed - stopped < 4 + 30, f"rank 0 failed {failed - stopped:.1f} s after the stop"
    limit = launch.SHUTDOWN_TIMEOUT + EXIT_AFTER_DONE_S
    assert ended - failed < limit, f"ended {ended - failed:.1f} s after rank 0 failed"
    line = _one_launcher_line(run)
    # Where rank 0 waits depends on where the stop caught rank 1: a data-parallel bucket or
    # the gradient norm (megacore), or the loss's average (megatrain's step).
    assert re.match(
        r"megatrain run: worker rank 0 failed: CollectiveFailure: rank 0 waited 4 s in .+ "
        r"\(mega(core|train)/\S+\.py:\d+\) at iteration \d+, and rank\(s\) 1 never arrived: "
        r"stuck or dead",
        line,
    ), line


def test_max_restarts_needs_somewhere_to_resume_from(corpus, tmp_path):
    result = CliRunner().invoke(main, _run(corpus, tmp_path / "out", "--max-restarts", "2")[3:])
    assert result.exit_code == 2
    assert "--max-restarts needs --save (or checkpoint.save)" in result.output
