"""Download the wheels bench_gpu.py's peers need on the GPU machine, which has no network.

    python scripts/fetch_gpu_wheels.py                 # here, with pip and a package index
    bash scripts/install_gpu_wheels.sh DIR             # there: into DIR, then PYTHONPATH=DIR

The GPU machine (Python 3.12, x86-64, manylinux) already has a CUDA torch, triton and the
nvidia-* libraries that go with it, and many common packages (`ON_GPU_IMAGE`); its torch must
stay.  So nothing is resolved by pip: each wheel is downloaded with `--no-deps` for that
interpreter, and its METADATA's Requires-Dist (markers evaluated for Python 3.12 on Linux, no
extras) names the next ones, except torch, triton and the CUDA wheels (`PROVIDED`) and what the
image has.  A dependency asked for twice must be satisfied by the one version downloaded.

Versions (`PEERS`), for the GPU image's torch 2.11:
- megatron-core 0.19.2: the newest; needs torch >= 2.6 and Python >= 3.12 (cp312 wheel).
- torchtitan 0.2.2, not 0.3.0: 0.3.0 imports `DataParallelMeshDims` from torch.distributed.fsdp,
  which torch 2.11 lacks (its releases pin a torch nightly), and dropped SDPA for its language
  models (flex or varlen attention only); 0.2.2 imports on torch 2.11 and trains with SDPA.
- torchao 0.18.0: its C++ ops load on torch >= 2.11 (torchao/__init__.py checks).
- liger-kernel 0.8.5: the newest; Triton kernels, torch >= 2.1.2.
The folder is carried with the working tree, so its size is printed and held under `LIMIT_MIB`.
"""

import argparse
import email.parser
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("megatron-core==0.19.2", "torchtitan==0.2.2", "torchao==0.18.0", "liger-kernel==0.8.5")
# Come with the GPU machine's CUDA torch; a second copy would replace or shadow them.
PROVIDED_PREFIXES = ("nvidia-", "cuda-")
PROVIDED = {"torch", "triton"}
# Python packages of the GPU image ('cuda'), as listed on 2026-11-17 (the device notes' list).
_GPU_IMAGE = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
    build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
    cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
    einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
    gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
    imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping
    jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
    llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py
    mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja
    numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
    nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
    nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless opt-einsum opt-einsum-fx optax optimistix orbax-checkpoint packaging
    pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
    protobuf psutil py-cpuinfo pyarrow pybind11 pygments pyparsing pyproject-hooks
    pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
    python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
    scikit-build-core scikit-image scikit-learn scipy seaborn sentence-transformers
    sentencepiece setuptools shellingham simplejson six sortedcontainers statsmodels sympy
    tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken
    timm tokenizers toolz torch torch-geometric torchaudio torchdiffeq torchmetrics torchvision
    tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
    wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
ON_GPU_IMAGE = set(_GPU_IMAGE.split())
LIMIT_MIB = 60
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")  # fmt: skip


def _vendored(module: str):
    """packaging as pip vendors it, for a Python that lacks it (as scripts/install.py)."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        return __import__(f"pip._vendor.{module}", fromlist=["_"])


Requirement = _vendored("packaging.requirements").Requirement
canonicalize_name = _vendored("packaging.utils").canonicalize_name
parse_wheel_filename = _vendored("packaging.utils").parse_wheel_filename


def download(spec: str, python_version: str, dest: Path) -> Path:
    """One wheel for the target interpreter, without its dependencies; its path in `dest`."""
    abi = "cp" + python_version.replace(".", "")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--only-binary=:all:", "--python-version", python_version,
               "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none",
               *(f"--platform={p}" for p in PLATFORMS), "-d", tmp, spec]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"fetch_gpu_wheels: no wheel of {spec} for cp{abi[2:]} x86-64:\n{proc.stderr}")
        (wheel,) = Path(tmp).glob("*.whl")
        return Path(shutil.copy2(wheel, dest / wheel.name))


def requires(wheel: Path, python_version: str) -> list:
    """The wheel's Requires-Dist that apply to Linux x86-64 on `python_version`, no extras."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.BytesParser().parsebytes(z.read(name))
    env = {"python_version": python_version, "python_full_version": f"{python_version}.0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "os_name": "posix", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "extra": ""}  # fmt: skip
    reqs = [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def skip_reason(name: str) -> str | None:
    if name in PROVIDED or name.startswith(PROVIDED_PREFIXES):
        return "comes with the GPU machine's CUDA torch"
    if name in ON_GPU_IMAGE:
        return "on the GPU image"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "wheels" / "gpu")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    args = parser.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)  # one version of each package, none left from an older list
    args.out.mkdir(parents=True)

    queue = [Requirement(spec) for spec in PEERS]
    versions: dict[str, str] = {}  # canonical name -> the version downloaded
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in versions:
            if not req.specifier.contains(versions[name], prereleases=True):
                sys.exit(f"fetch_gpu_wheels: {req} is asked for, but {name} {versions[name]} "
                         "was downloaded for another package")  # fmt: skip
            continue
        wheel = download(str(req), args.python_version, args.out)
        versions[name] = str(parse_wheel_filename(wheel.name)[1])
        print(f"  {wheel.name} ({wheel.stat().st_size / 2**20:.2f} MiB)")
        for dep in requires(wheel, args.python_version):
            reason = skip_reason(canonicalize_name(dep.name))
            if reason:
                print(f"    skip {dep} ({reason})")
            else:
                queue.append(dep)

    total = sum(w.stat().st_size for w in args.out.glob("*.whl")) / 2**20
    print(f"{len(versions)} wheels, {total:.1f} MiB in {args.out}")
    if total > LIMIT_MIB:
        sys.exit(f"fetch_gpu_wheels: {total:.1f} MiB is over {LIMIT_MIB} MiB, too much to carry")


if __name__ == "__main__":
    main()
