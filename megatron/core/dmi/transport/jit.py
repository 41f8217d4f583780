"""Just-in-time build of the native ring (``csrc/dmi``) with ``torch.utils.cpp_extension.load``.

Two extensions:

* ``host``: C++ only, CPU tensors (builds anywhere a C++ compiler exists, in seconds);
* ``cuda``: the same protocol with a device payload ring, producer kernels and a drain thread that
  copies with the copy engine. Built for sm_90 (``TORCH_CUDA_ARCH_LIST`` overrides).

Builds are cached in ``TORCH_EXTENSIONS_DIR`` (torch's default when unset) under a name that hashes
the sources, flags and torch version, so a cached build is never stale. A file lock around the build
makes one local rank build while the others wait and then load the cached result.

Importing this module needs only torch (not megatron-core).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.transport import abi

if TYPE_CHECKING:
    from megatron.core.dmi.transport.native_api import CudaModule, HostModule

HOST_SOURCES = ("host_ring.cpp",)
CUDA_SOURCES = ("cuda_ring.cu", "router_select.cu", "cuda_ring_bind.cpp")
DEFAULT_CUDA_ARCH = "9.0"
_CFLAGS = ["-O3", "-std=c++17"]

_loaded: dict[str, object] = {}
_timings: dict[str, dict] = {}


class NativeBuildError(DMIError, RuntimeError):
    """The native ring cannot be built or loaded here (the torch transport stays usable)."""


def csrc_dir() -> Path:
    """Where the C++/CUDA sources are: inside the installed package, else the repo's csrc/dmi."""
    here = Path(__file__).resolve()
    candidates = [
        here.parents[1] / "csrc",  # pip install . copies csrc/dmi to megatron/core/dmi/csrc
        here.parents[4] / "csrc" / "dmi",  # repo checkout / pip install -e .
    ]
    env = os.environ.get("DMI_CSRC_DIR")
    if env:
        candidates.insert(0, Path(env))
    for c in candidates:
        if (c / "ring_protocol.h").is_file():
            return c
    raise NativeBuildError(f"DMI native sources not found (looked in {', '.join(map(str, candidates))})")


def _find_cxx() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    return shutil.which(cxx) or shutil.which("g++") or shutil.which("clang++")


def find_cuda_home() -> str | None:
    """CUDA toolkit root: CUDA_HOME/CUDA_PATH if it holds nvcc, else derived from ``which nvcc``."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(os.path.realpath(nvcc))
        if (real.parent.parent / "include" / "cuda_runtime.h").exists():
            return str(real.parent.parent)
        for guess in ("/usr/local/cuda", *sorted(Path("/usr/local").glob("cuda-*"), reverse=True)):
            if (Path(guess) / "bin" / "nvcc").exists():
                return str(guess)
    for guess in ("/usr/local/cuda",):
        if (Path(guess) / "bin" / "nvcc").exists():
            return guess
    return None


def _nvcc_version(cuda_home: str) -> str | None:
    try:
        out = subprocess.run(
            [str(Path(cuda_home) / "bin" / "nvcc"), "--version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.stdout.splitlines():
        if "release" in line:
            return line.split("release", 1)[1].split(",")[0].strip()
    return None


def _arch_list() -> list[str]:
    spec = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_CUDA_ARCH
    archs = [a.strip() for a in spec.replace(";", " ").replace(",", " ").split() if a.strip()]
    return archs or [DEFAULT_CUDA_ARCH]


def _gencode_flags(archs: list[str]) -> list[str]:
    flags = []
    for a in archs:
        ptx = a.endswith("+PTX")
        num = a.replace("+PTX", "").replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def extensions_dir() -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def _variant(kind: str) -> tuple[str, list[Path], dict]:
    src = csrc_dir()
    names = HOST_SOURCES if kind == "host" else CUDA_SOURCES
    sources = [src / n for n in names]
    h = hashlib.sha256()
    for p in sorted(src.glob("*")):
        if p.suffix in (".h", ".cpp", ".cu", ".cuh"):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    opts: dict = {"extra_cflags": list(_CFLAGS)}
    if kind == "cuda":
        opts["extra_cuda_cflags"] = ["-O3", "-std=c++17", "--use_fast_math", *_gencode_flags(_arch_list())]
    h.update(repr((torch.__version__, sys.version_info[:2], sorted(opts.items()))).encode())
    name = f"dmi_ring_{kind}_{h.hexdigest()[:12]}"
    return name, sources, opts


def _lib_path(build_dir: Path, name: str) -> Path:
    return build_dir / f"{name}.so"


@contextlib.contextmanager
def _build_lock(root: Path, name: str):
    """An advisory file lock: the first local rank builds, the others wait for it (released by the
    kernel if the holder dies)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _prepare_cuda_env() -> str:
    cuda_home = find_cuda_home()
    if cuda_home is None:
        raise NativeBuildError(
            "cannot build the DMI CUDA ring: no nvcc found (set CUDA_HOME or put nvcc on PATH); "
            "use --dmi-transport torch"
        )
    os.environ.setdefault("CUDA_HOME", cuda_home)
    import torch.utils.cpp_extension as ce

    if ce.CUDA_HOME is None or not (Path(ce.CUDA_HOME) / "include" / "cuda_runtime.h").exists():
        # torch resolved it at import time from `which nvcc`, which can be a wrapper script
        # (/usr/local/bin/nvcc -> CUDA_HOME=/usr/local without CUDA headers).
        ce.CUDA_HOME = cuda_home
        os.environ["CUDA_HOME"] = cuda_home
    return cuda_home


def _load(kind: str, verbose: bool = False, import_module: bool = True):
    if kind in _loaded and import_module:
        return _loaded[kind]
    if _find_cxx() is None:
        raise NativeBuildError(
            "cannot build the DMI native ring: no C++ compiler found (install g++ or set CXX); "
            "use --dmi-transport torch"
        )
    if kind == "cuda":
        _prepare_cuda_env()
    name, sources, opts = _variant(kind)
    root = extensions_dir()
    build_dir = root / name
    cached = _lib_path(build_dir, name).exists()
    from torch.utils import cpp_extension as ce

    t0 = time.perf_counter()
    with _build_lock(root, name):
        build_dir.mkdir(parents=True, exist_ok=True)
        cached = cached or _lib_path(build_dir, name).exists()
        try:
            if kind == "cuda" and not import_module:
                # Compile + link only (a CPU machine with nvcc cannot run the kernels).
                mod = None
                _build_only(ce, name, sources, opts, build_dir, verbose)
            else:
                mod = ce.load(
                    name=name,
                    sources=[str(s) for s in sources],
                    build_directory=str(build_dir),
                    extra_include_paths=[str(csrc_dir())],
                    verbose=verbose,
                    with_cuda=(kind == "cuda"),
                    **opts,
                )
        except (RuntimeError, OSError, ImportError) as ex:  # compiler errors, missing toolkit, a bad library
            raise NativeBuildError(f"building the DMI {kind} ring failed: {ex}") from ex
    seconds = time.perf_counter() - t0
    _timings[kind] = {"name": name, "seconds": seconds, "cached": cached, "build_dir": str(build_dir)}
    if mod is not None:
        abi.check(mod, kind)
        _loaded[kind] = mod
    return mod


def _build_only(ce, name, sources, opts, build_dir: Path, verbose: bool) -> None:
    """Build the shared library exactly as ``load`` would, without importing it."""
    build = getattr(ce, "_write_ninja_file_and_build_library", None)
    if build is None:  # very old/new torch: fall back to load, tolerate the import failing
        try:
            ce.load(
                name=name,
                sources=[str(s) for s in sources],
                build_directory=str(build_dir),
                extra_include_paths=[str(csrc_dir())],
                verbose=verbose,
                with_cuda=True,
                **opts,
            )
        except ImportError:
            pass
        return
    kwargs = dict(
        name=name,
        sources=[str(s) for s in sources],
        extra_cflags=opts.get("extra_cflags", []),
        extra_cuda_cflags=opts.get("extra_cuda_cflags", []),
        extra_ldflags=[],
        extra_include_paths=[str(csrc_dir())],
        build_directory=str(build_dir),
        verbose=verbose,
        with_cuda=True,
    )
    import inspect

    if "extra_sycl_cflags" in inspect.signature(build).parameters:
        kwargs["extra_sycl_cflags"] = []
    if "with_sycl" in inspect.signature(build).parameters:
        kwargs["with_sycl"] = False
    build(**kwargs)
    if not _lib_path(build_dir, name).exists():
        raise NativeBuildError(f"build finished but {_lib_path(build_dir, name)} is missing")


def load_host(verbose: bool = False) -> HostModule:
    """The host (CPU) build, compiled on first use and cached."""
    return _load("host", verbose)


def load_cuda(verbose: bool = False) -> CudaModule:
    """The CUDA build, compiled on first use and cached."""
    return _load("cuda", verbose)


def loaded(kind: str):
    """The ``host`` or ``cuda`` module if this process has already loaded it, else None (never builds)."""
    return _loaded.get(kind)


def compile_cuda_only(verbose: bool = False) -> dict:
    """Compile and link the CUDA build without loading it (works on a CPU-only machine with nvcc).
    Returns the timing entry: name, seconds, cached, build_dir, library."""
    _load("cuda", verbose, import_module=False)
    info = dict(_timings["cuda"])
    info["library"] = str(_lib_path(Path(info["build_dir"]), info["name"]))
    return info


def build_timings() -> dict:
    """How long each native build took to build or load in this process."""
    return {k: dict(v) for k, v in _timings.items()}


def build_report() -> dict:
    """What can be built here, for ``doctor``: compiler, nvcc, ninja, arch list, cache state."""
    from torch.utils import cpp_extension as ce

    report: dict = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": sys.version.split()[0]}
    cxx = _find_cxx()
    report["cxx"] = cxx
    report["ninja"] = ce.is_ninja_available()  # asks `ninja --version`, False on any failure
    cuda_home = find_cuda_home()
    report["cuda_home"] = cuda_home
    report["nvcc"] = str(Path(cuda_home) / "bin" / "nvcc") if cuda_home else None
    report["nvcc_version"] = _nvcc_version(cuda_home) if cuda_home else None
    report["cuda_arch_list"] = _arch_list()
    report["cuda_available"] = torch.cuda.is_available()
    report["extensions_dir"] = str(extensions_dir())
    try:
        report["csrc_dir"] = str(csrc_dir())
        sources_ok = True
    except NativeBuildError as ex:
        report["csrc_dir"] = None
        report["error"] = str(ex)
        sources_ok = False
    for kind in ("host", "cuda"):
        entry: dict = {}
        can = sources_ok and cxx is not None and report["ninja"] and (kind == "host" or cuda_home is not None)
        entry["can_build"] = bool(can)
        entry["can_run"] = bool(can and (kind == "host" or torch.cuda.is_available()))
        if sources_ok:
            name, _, _ = _variant(kind)
            entry["name"] = name
            entry["cached"] = _lib_path(extensions_dir() / name, name).exists()
        if kind in _timings:
            entry["last_build_seconds"] = _timings[kind]["seconds"]
            entry["last_build_was_cached"] = _timings[kind]["cached"]
        entry["loaded"] = kind in _loaded
        report[kind] = entry
    return report


def native_available(device_type: str) -> bool:
    """True when the native build for this device type can be loaded (building it if needed)."""
    try:
        (load_cuda if device_type == "cuda" else load_host)()
        return True
    except NativeBuildError:
        return False


__all__ = [
    "NativeBuildError",
    "build_report",
    "build_timings",
    "compile_cuda_only",
    "csrc_dir",
    "find_cuda_home",
    "load_cuda",
    "load_host",
    "native_available",
]

if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(build_report(), indent=2))
