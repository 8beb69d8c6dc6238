"""Create the development virtual environment and install the four packages into it.

Called by `make install` after the Makefile has checked the Python version.
Steps: create the venv (seeing the base interpreter's site-packages when that
already has a torch megacore accepts, so a CUDA build is reused, not replaced),
install `--torch` with pip unless a suitable torch is importable, then the packages
in editable mode with their test extras and the root dev extras.

The packages go in with uv when it is on PATH or pip can install it into the venv
(`--installer auto`, the default; ten times faster than pip), else with pip, which
is also the fallback when uv fails for any reason (`--installer pip` forces it).
torch itself always goes in with pip: uv reads none of pip's configuration, and on
a machine whose pip finds the CPU build through its find-links uv would fetch the
CUDA one.  uv is handed pip's configured indexes, find-links and constraints, and
resolves as pip does (the best version over every index).

The installers' output goes to <venv>/install.log (pip at its default verbosity:
enough to explain a failure); on failure this prints one line that says what could
not be installed and why, and exits 1.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("megacommon", "megacore", "megadata", "megatrain", "megaeval")

# pip's words for "the index could not be reached" (urllib3, requests, socket errors).
NETWORK_ERROR = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Connection refused"
    r"|Temporary failure in name resolution|Name or service not known|Network is unreachable"
    r"|No route to host|ConnectTimeoutError|Read timed out|ProxyError|SSLError"
    r"|Could not fetch URL|connection broken"
)


def _vendored(module: str):
    """packaging and tomli as pip vendors them, for a base Python that lacks them."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        return __import__(f"pip._vendor.{module}", fromlist=["_"])


def torch_requirement():
    """megacore's torch requirement, the one range every package agrees on."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = _vendored("tomli")
    requirement_cls = _vendored("packaging.requirements").Requirement
    with open(ROOT / "packages" / "megacore" / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return next(r for r in map(requirement_cls, deps) if r.name == "torch")


def importable_torch(python: Path | str) -> str | None:
    """The version of torch that `python` imports, or None."""
    code = "import torch; print(torch.__version__)"
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def satisfies(version: str | None, requirement) -> bool:
    # Local labels (+cpu, +cu128) do not matter for the range.
    return version is not None and requirement.specifier.contains(
        version.split("+")[0], prereleases=True
    )


def fail(message: str) -> None:
    print(f"make install: {message}", file=sys.stderr)
    sys.exit(1)


def pip_config(python: Path) -> dict[str, list[str]]:
    """pip's configured sources, from its files and environment (`pip config list`): the
    index-url, extra-index-url, find-links, constraint and cert values, each a list."""
    listing = subprocess.run([str(python), "-m", "pip", "config", "list"], capture_output=True)
    keys = ("index-url", "extra-index-url", "find-links", "constraint", "cert")
    found: dict[str, list[str]] = {key: [] for key in keys}
    lines = listing.stdout.decode().splitlines()
    # The environment's values (":env:.") after the files' (global., user., site.): pip lets
    # them win.
    for line in sorted(lines, key=lambda line: line.startswith(":env:")):
        name, _, value = line.partition("=")
        key = name.rpartition(".")[2]
        if key in found:
            # A single value: the last scope's; lists: every scope's.
            values = value.strip("'\"").split()
            found[key] = values if key in ("index-url", "cert") else found[key] + values
    return found


def index_urls(python: Path) -> list[str]:
    """The package indexes pip is configured with (files, environment), PyPI by default."""
    config = pip_config(python)
    return (config["index-url"] or ["https://pypi.org/simple"]) + config["extra-index-url"]


def answers(url: str) -> bool:
    """Whether anything answers at `url` (any HTTP status counts: the server is there)."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        return Path(urllib.request.url2pathname(parsed.path)).exists()
    try:
        urllib.request.urlopen(url, timeout=10).close()
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False
    return True


def explain_pip_failure(python: Path, output: str, what: str, log: Path) -> str:
    missing = re.findall(r"No matching distribution found for (\S+)", output)
    target = missing[0] if missing else what
    # pip names connection errors only at high verbosity, and not at all for the installs of
    # build dependencies it runs in a subprocess: when nothing was found, ask the indexes.
    urls = index_urls(python) if missing else []
    if NETWORK_ERROR.search(output) or (urls and not any(map(answers, urls))):
        where = f" ({', '.join(urls)})" if urls else ""
        return (
            f"cannot reach the package index{where} to get {target}; check the network, proxy "
            f"or PIP_INDEX_URL and run make install again (pip log: {log})"
        )
    if missing:
        return f"no release of {target} on the package index fits this machine (pip log: {log})"
    errors = [line for line in output.splitlines() if line.startswith("ERROR:")]
    reason = errors[-1].removeprefix("ERROR:").strip() if errors else "see the log"
    return f"pip could not install {what}: {reason} (pip log: {log})"


def run_logged(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`cmd` run from the repository root, its command line and output appended to `log`."""
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    return proc


def pip_install(python: Path, args: list[str], what: str, log: Path) -> None:
    print(f"installing {what} (log: {log})", flush=True)
    # At pip's default verbosity: a line a package, not the megabytes of -vv.  A connection
    # error pip does not name is found by asking the indexes (explain_pip_failure).
    cmd = [str(python), "-m", "pip", "install", "--disable-pip-version-check", *args]
    proc = run_logged(cmd, log)
    if proc.returncode != 0:
        fail(explain_pip_failure(python, proc.stdout + proc.stderr, what, log))


def find_uv(python: Path, log: Path) -> Path | None:
    """uv: already in the venv, on PATH, or installed into the venv by pip (a few seconds, from
    the same indexes); None when it cannot be had (the packages then go in with pip)."""
    in_venv = python.parent / "uv"
    if in_venv.exists():
        return in_venv
    if on_path := shutil.which("uv"):
        return Path(on_path)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "uv"]
    if run_logged(pip, log).returncode == 0 and in_venv.exists():
        return in_venv
    print(f"uv could not be installed (see {log}): installing with pip", flush=True)
    return None


def uv_install(uv: Path, python: Path, args: list[str], what: str, log: Path) -> bool:
    """`uv pip install args` into the venv from pip's configured sources; False (and a line
    saying so) when uv fails, for the caller to fall back to pip, whose failure explains."""
    config = pip_config(python)
    sources = ["--index-strategy", "unsafe-best-match"]  # pip's: the best over every index
    for url in config["index-url"]:
        sources += ["--index-url", url]
    for url in config["extra-index-url"]:
        sources += ["--extra-index-url", url]
    for place in config["find-links"]:
        sources += ["--find-links", place]
    for path in config["constraint"]:
        sources += ["--constraint", path]
    env = dict(os.environ)
    if config["cert"]:  # pip's CA bundle (a proxy's own, say) for uv's TLS too
        env.setdefault("SSL_CERT_FILE", config["cert"][0])
    print(f"installing {what} with uv (log: {log})", flush=True)
    # --compile-bytecode: as pip does by default.  Without it every process compiles the
    # sources it imports (transformers, matplotlib: seconds a process start) whenever the
    # environment forbids writing .pyc files (PYTHONDONTWRITEBYTECODE), as CI machines may.
    cmd = [str(uv), "pip", "install", "--python", str(python), "--compile-bytecode"]
    cmd += [*sources, *args]
    proc = run_logged(cmd, log, env)
    if proc.returncode != 0:
        print(f"uv could not install them (see {log}): installing with pip", flush=True)
    return proc.returncode == 0


def create_venv(venv: Path, torch_req) -> None:
    base_torch = importable_torch(sys.executable)
    cmd = [sys.executable, "-m", "venv", str(venv)]
    if satisfies(base_torch, torch_req):
        if sys.prefix != sys.base_prefix:  # a venv's packages cannot be shared with another venv
            print(
                f"note: {sys.executable} is a virtual environment with torch {base_torch}; "
                f"to install into it instead of a new one: make install VENV={sys.prefix}"
            )
        else:
            cmd.append("--system-site-packages")
            print(f"reusing torch {base_torch} from {sys.executable} (venv sees its packages)")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        detail = (proc.stdout + proc.stderr).strip().splitlines()
        hint = "; on Debian/Ubuntu: apt install python3-venv" if "ensurepip" in proc.stderr else ""
        fail(f"{sys.executable} could not create {venv}: {detail[-1] if detail else '?'}{hint}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv")
    parser.add_argument("--torch", default="torch==2.13.0", help="what to install if no torch fits")
    parser.add_argument("--torch-index", default="", help="package index URL for the torch step")
    parser.add_argument(
        "--installer",
        choices=("auto", "pip"),
        default="auto",
        help="auto: the packages with uv where it can be had, else pip; pip: pip only",
    )
    opts = parser.parse_args()

    venv = opts.venv if opts.venv.is_absolute() else ROOT / opts.venv
    python = venv / "bin" / "python"
    torch_req = torch_requirement()
    if not python.exists():
        create_venv(venv, torch_req)
    log = venv / "install.log"
    log.write_text("")  # this run's output only

    torch_version = importable_torch(python)
    if satisfies(torch_version, torch_req):
        print(f"keeping torch {torch_version}")
    else:
        if torch_version:
            print(f"torch {torch_version} does not satisfy megacore's {torch_req}")
        index = ["--index-url", opts.torch_index] if opts.torch_index else []
        pip_install(python, [*index, opts.torch], opts.torch, log)

    editables = ["-e", ".[dev]"]
    for name in PACKAGES:
        editables += ["-e", f"packages/{name}[test]"]
    what = ", ".join(PACKAGES) + " (editable, with test extras)"
    uv = find_uv(python, log) if opts.installer != "pip" else None
    if uv is None or not uv_install(uv, python, editables, what, log):
        pip_install(python, editables, what, log)
    compile_sources(python, log)
    print(f"ready: {venv}")


def compile_sources(python: Path, log: Path) -> None:
    """Byte-compile the editable packages' sources once: a test suite starts hundreds of
    processes, and where .pyc files may not be written at import (PYTHONDONTWRITEBYTECODE)
    each would compile megatrain's modules again (measured: importing torch, transformers,
    matplotlib and megatrain took 23-30 s a process beside 9-10 s compiled, on the 2-core CI
    machine under load).  A source edited later is simply recompiled at import, as before."""
    sources = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
    run_logged([str(python), "-m", "compileall", "-q", *sources], log)


if __name__ == "__main__":
    main()
