"""Each package installs and runs on its own, with nothing but its declared dependencies.

A package is built into a wheel and installed, with pip's index and find-links
off, into a fresh virtual environment that can see only the distributions its
declared requirements resolve to (linked from the development environment, so
the check needs no network and never downloads torch).  A dependency the
package forgot to declare, or one it must not have (torch in megadata), fails
the install or the import.
"""

import os
import subprocess
import sys
import venv
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def pip(*args: str) -> subprocess.CompletedProcess:
    """The dev venv's pip with no configuration: no index or find-links from outside."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    cmd = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def build_wheel(package: str, out: Path) -> Path:
    proc = pip(
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(out),
        str(ROOT / "packages" / package),
    )
    assert proc.returncode == 0, f"{package} does not build:\n{proc.stderr}"
    return next(out.glob(f"{package}-*.whl"))


def runtime(reqs) -> list[Requirement]:
    """Requirements that apply to a plain install (those behind an extra, like [test], do not)."""
    reqs = [r if isinstance(r, Requirement) else Requirement(r) for r in reqs or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """Runtime requirements as the built wheel declares them (extras such as [test] left out)."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(name).decode())
    return runtime(meta.get_all("Requires-Dist"))


def dependency_closure(reqs: list[Requirement], skip: set[str]) -> list[metadata.Distribution]:
    """The installed distributions that `reqs` resolve to, transitively, here in the dev venv."""
    found: dict[str, metadata.Distribution] = {}
    todo = [r for r in reqs if r.name.lower() not in skip]
    while todo:
        req = todo.pop()
        key = req.name.lower().replace("_", "-")
        if key in found:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise AssertionError(
                f"{req} is declared but not installed in {sys.prefix}: run make install"
            ) from None
        found[key] = dist
        todo += runtime(dist.requires)
    return list(found.values())


def expose(dists: list[metadata.Distribution], stage: Path) -> None:
    """Link each distribution's top-level files (code and .dist-info) into `stage`."""
    for dist in dists:
        for file in dist.files or []:
            top = file.parts[0]
            source = Path(dist.locate_file(top))
            if top == ".." or not source.exists() or (stage / top).exists():
                continue  # ".." entries are console scripts outside site-packages
            (stage / top).symlink_to(source)


def fresh_env(where: Path) -> Path:
    """A venv without pip whose site-packages also reads `where/stage` (empty at first)."""
    venv.create(where / "venv", with_pip=False)
    python = where / "venv" / "bin" / "python"
    site = subprocess.check_output([python, "-c", "import site; print(site.getsitepackages()[0])"])
    (where / "stage").mkdir()
    Path(site.decode().strip(), "stage.pth").write_text(str(where / "stage") + "\n")
    return python


def install_alone(python: Path, wheel: Path) -> None:
    """Install into `python`'s environment with no index: the staged dependencies or nothing."""
    proc = pip("--python", str(python), "install", "--no-index", str(wheel))
    assert proc.returncode == 0, f"{wheel.name} does not install alone:\n{proc.stderr}"


def import_all(python: Path, package: str, forbidden: str = "") -> None:
    """Import the package and every submodule in `python`; none may pull in `forbidden`."""
    code = (
        "import importlib, pkgutil, sys\n"
        f"pkg = importlib.import_module({package!r})\n"
        f"for m in pkgutil.walk_packages(pkg.__path__, {package + '.'!r}):\n"
        "    importlib.import_module(m.name)\n"
        f"bad = {forbidden!r}\n"
        "assert not bad or bad not in sys.modules, f'importing {pkg.__name__} imported {bad}'\n"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"{package} does not import alone:\n{proc.stderr}"


def run_cli(python: Path, command: str, version: str) -> None:
    exe = python.parent / command
    help_ = subprocess.run([exe, "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and f"Usage: {command}" in help_.stdout, help_.stderr
    shown = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert shown.stdout.strip() == f"{command}, version {version}", shown.stdout + shown.stderr


def package_version(package: str) -> str:
    """The version as written in the package's pyproject.toml, its single source."""
    with open(ROOT / "packages" / package / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def test_megacommon_then_megadata_install_and_run_without_torch(tmp_path):
    # megacommon first, alone (click, pyarrow and tqdm); then megadata, which may see only
    # megacommon and its own declared requirements.  Neither may import torch.
    python = fresh_env(tmp_path)
    for package in ("megacommon", "megadata"):
        wheel = build_wheel(package, tmp_path / "wheels")
        reqs = wheel_requirements(wheel)
        if package == "megacommon":
            assert sorted(r.name for r in reqs) == ["click", "pyarrow", "tqdm"]
        else:  # installed before it, so only the declaration shows that megadata needs it
            assert "megacommon" in {r.name for r in reqs}
        expose(dependency_closure(reqs, skip={"megacommon"}), tmp_path / "stage")
        install_alone(python, wheel)
        torch_probe = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True)
        assert "No module named 'torch'" in torch_probe.stderr, f"torch is visible to {package}"
        import_all(python, package, forbidden="torch")
    run_cli(python, "megadata", package_version("megadata"))


def test_megacore_with_torch_and_numpy_only_then_megatrain_and_megaeval(tmp_path):
    # Each package in turn, in one venv: the next one may see only what the previous
    # ones installed plus its own declared requirements.  megacore comes first, so it
    # imports with nothing but torch and numpy; megacommon before the two that need it.
    python = fresh_env(tmp_path)
    ours = {"megacommon", "megacore", "megatrain", "megaeval"}
    for package in ("megacore", "megacommon", "megatrain", "megaeval"):
        wheel = build_wheel(package, tmp_path / "wheels")
        reqs = wheel_requirements(wheel)
        if package == "megacore":
            assert sorted(r.name for r in reqs) == ["numpy", "torch"]
        if package in ("megatrain", "megaeval"):
            assert "megacommon" in {r.name for r in reqs}
        expose(dependency_closure(reqs, skip=ours), tmp_path / "stage")
        install_alone(python, wheel)
        import_all(python, package)
        if package in ("megatrain", "megaeval"):
            run_cli(python, package, package_version(package))
