"""`make install`: a no-op when done, and one clear line when it cannot be done."""

import glob
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEV_VENV = Path(sys.prefix)


def make(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


def our_error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """stderr without make's own closing 'make: *** [...] Error 1'."""
    make_says = re.compile(r"make(\[\d+\])?: ")
    return [line for line in proc.stderr.splitlines() if line and not make_says.match(line)]


def old_python(tmp_path: Path) -> str:
    """A real interpreter older than 3.10 if this machine has one, else a stand-in that acts like
    one towards the Makefile: it fails the version probe and reports an old version."""
    names = [f"python3.{minor}" for minor in range(9, 5, -1)] + ["python2"]
    candidates = [shutil.which(n) for n in names]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/*/bin/python")))
    probe = "import sys; sys.exit(sys.version_info >= (3, 10))"
    for exe in filter(None, candidates):
        if subprocess.run([exe, "-c", probe], capture_output=True).returncode == 0:
            return exe
    fake = tmp_path / "python3.8"
    fake.write_text('#!/bin/sh\ncase "$1" in -V) echo "Python 3.8.18";; *) exit 1;; esac\n')
    fake.chmod(0o755)
    return str(fake)


def test_second_install_has_nothing_to_do():
    # `make -q` exits 0 only when the target is up to date, i.e. running it would change nothing.
    assert make("-q", "install", f"VENV={DEV_VENV}").returncode == 0


def test_old_or_missing_python_stops_with_one_line(tmp_path):
    venv_dir = tmp_path / "venv"
    python = old_python(tmp_path)
    proc = make("install", f"PYTHON={python}", f"VENV={venv_dir}")
    assert proc.returncode != 0
    (line,) = our_error_lines(proc)
    assert "needs Python >= 3.10" in line and f"{python} is Python " in line, line
    assert not venv_dir.exists()

    proc = make("install", "PYTHON=no-such-python3", f"VENV={venv_dir}")
    assert proc.returncode != 0
    assert "no Python interpreter 'no-such-python3' found" in (proc.stdout + proc.stderr)


def install_without_index(
    tmp_path: Path, python: Path, *make_args: str
) -> tuple[subprocess.CompletedProcess, str]:
    """`make install` into a new venv with the package index pointing at a closed local port."""
    with socket.socket() as s:  # a port on this machine that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(
        PIP_CONFIG_FILE=os.devnull,  # no site pip.conf: only the dead index below
        PIP_INDEX_URL=f"http://127.0.0.1:{port}/simple",
        PIP_RETRIES="0",
        PIP_TIMEOUT="5",
        PIP_NO_CACHE_DIR="1",
    )
    venv_dir = tmp_path / "venv"
    proc = make("install", f"PYTHON={python}", f"VENV={venv_dir}", *make_args, env=env)
    assert proc.returncode != 0
    assert not (venv_dir / ".installed").exists()
    (line,) = our_error_lines(proc)
    index = f"http://127.0.0.1:{port}/simple"
    assert line.startswith(f"make install: cannot reach the package index ({index}) to get "), line
    assert "install.log" in line
    return proc, line


def test_unreachable_package_index_stops_with_one_line(tmp_path):
    base_python = Path(sys.base_prefix) / "bin" / "python3"
    _, line = install_without_index(tmp_path, base_python)
    assert " to get torch==2.13.0;" in line  # this base Python has no torch: torch is missing


def fake_cuda_torch_python(tmp_path: Path) -> Path:
    """A base Python that imports a torch the packages accept, as a CUDA build in a GPU
    container: a stand-in with installed metadata, seen through PYTHONPATH."""
    fake = tmp_path / "site"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text('__version__ = "2.99.0+cu128"\n')
    (fake / "torch-2.99.0.dist-info").mkdir()
    (fake / "torch-2.99.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 2.99.0\n"
    )
    base = tmp_path / "python3"
    base.write_text(
        f'#!/bin/sh\nPYTHONPATH={fake} exec {Path(sys.base_prefix) / "bin" / "python3"} "$@"\n'
    )
    base.chmod(0o755)
    return base


def test_a_torch_the_packages_accept_is_kept(tmp_path):
    proc, line = install_without_index(tmp_path, fake_cuda_torch_python(tmp_path))
    assert "reusing torch 2.99.0+cu128" in proc.stdout
    assert "keeping torch 2.99.0+cu128" in proc.stdout
    # It got past torch without touching it; only the packages' own needs were missing.
    missing = re.search(r" to get (\S+);", line).group(1)
    assert not missing.startswith("torch"), line
    assert "installing torch" not in proc.stdout
    # No uv to be had from a dead index (none on PATH here, or one that cannot reach it
    # either): the packages went in with pip, whose failure is the line above.
    assert "installing with pip" in proc.stdout, proc.stdout


def test_installer_pip_forces_the_fallback(tmp_path):
    """`make install INSTALLER=pip`: uv is neither looked for nor installed; pip installs the
    packages (and explains its failure in the same one line)."""
    proc, _ = install_without_index(tmp_path, fake_cuda_torch_python(tmp_path), "INSTALLER=pip")
    assert "with uv" not in proc.stdout and "uv could not" not in proc.stdout, proc.stdout
    assert "installing megacommon" in proc.stdout
    log = (tmp_path / "venv" / "install.log").read_text()
    assert "pip install --disable-pip-version-check uv" not in log
    assert "uv pip install" not in log


def test_the_install_log_is_quiet_and_torch_is_the_machines_build():
    """The dev venv's install.log holds what explains a failure, not pip's -vv megabytes; on a
    machine without a GPU its torch is a CPU build (uv, which reads none of pip's find-links,
    would have fetched the CUDA one)."""
    log = DEV_VENV / "install.log"
    if log.exists():
        assert log.stat().st_size < 1_000_000, log.stat().st_size
    if shutil.which("nvidia-smi") is None:
        code = "import torch; print(torch.version.cuda, torch.__version__)"
        out = subprocess.run([str(DEV_VENV / "bin" / "python"), "-c", code], capture_output=True)
        cuda, version = out.stdout.decode().split()
        assert cuda == "None", version


def test_the_installed_modules_are_byte_compiled():
    """Where the environment forbids writing .pyc files at import (PYTHONDONTWRITEBYTECODE, as on
    the CI machines), a module left uncompiled is compiled again by every process that imports
    it: `make install` compiles the dependencies (uv's --compile-bytecode, pip's default) and
    the editable packages' sources once."""
    from importlib.util import cache_from_source

    import matplotlib
    import transformers

    import megatrain.run.loop

    for module in (transformers, matplotlib, megatrain.run.loop):
        assert Path(cache_from_source(module.__file__)).exists(), module.__file__
