"""JIT build of the native ring: report, cached host build, compile-only CUDA build."""

import json
import time

import pytest

from megatron.core.dmi.transport import jit


def test_build_report_describes_what_can_build_here():
    jit.load_host()
    rep = jit.build_report()
    json.dumps(rep)  # plain data, for `doctor`
    for field in ("cxx", "ninja", "cuda_home", "nvcc", "nvcc_version", "cuda_arch_list", "extensions_dir", "csrc_dir"):
        assert field in rep
    assert rep["host"]["can_build"] and rep["host"]["can_run"] and rep["host"]["cached"] and rep["host"]["loaded"]
    assert rep["host"]["last_build_seconds"] >= 0
    assert rep["cuda_arch_list"] == ["9.0"] or rep["cuda_arch_list"]  # TORCH_CUDA_ARCH_LIST may override
    assert rep["csrc_dir"].endswith("dmi") or rep["csrc_dir"].endswith("csrc")


def test_cached_host_build_loads_from_cache_in_a_new_process_without_compiling(tmp_path):
    """A second process loads the cached library: nothing is compiled or linked and the library is not
    rebuilt. Both processes build into their own extensions folder (this process may have loaded its
    ring from another one, set by an earlier test). The compilers on PATH are wrapped by scripts that
    log each call (and then run the real one, so a wrong answer still builds); torch's version probes
    (``c++ -v``) are no build. How long the load takes belongs in benchmarks, not here."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    code = (
        "import json; from megatron.core.dmi.transport import jit; jit.load_host(); "
        "print(json.dumps(jit.build_timings()['host']))"
    )
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))

    def load(env):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[-1])

    first = load(env)
    assert not first["cached"]  # a cold folder: this one built it
    lib = os.path.join(first["build_dir"], f"{first['name']}.so")
    built_at = os.stat(lib).st_mtime_ns
    wrappers, mark = tmp_path / "bin", tmp_path / "compiler-ran"
    wrappers.mkdir()
    for cc in ("c++", "g++", "gcc", "cc", "clang++", "nvcc"):
        real = shutil.which(cc)
        if real:
            w = wrappers / cc
            w.write_text(f'#!/bin/sh\necho "{cc} $*" >> {mark}\nexec {real} "$@"\n')
            w.chmod(0o755)
    second = load(dict(env, PATH=f"{wrappers}{os.pathsep}{env.get('PATH', '')}"))
    assert second["cached"] and second["build_dir"] == first["build_dir"]
    calls = mark.read_text().splitlines() if mark.exists() else []
    builds = [c for c in calls if {"-c", "-o"} & set(c.split())]
    assert not builds, f"a compiler built something: {builds}"
    assert os.stat(lib).st_mtime_ns == built_at


def test_missing_compiler_gives_a_clear_error(monkeypatch):
    monkeypatch.setattr(jit, "_find_cxx", lambda: None)
    monkeypatch.setattr(jit, "_loaded", {})
    with pytest.raises(jit.NativeBuildError, match="no C\\+\\+ compiler"):
        jit.load_host()
    monkeypatch.setattr(jit, "find_cuda_home", lambda: None)
    monkeypatch.setattr(jit, "_find_cxx", lambda: "/usr/bin/c++")
    with pytest.raises(jit.NativeBuildError, match="no nvcc"):
        jit.load_cuda()
    assert not jit.build_report()["cuda"]["can_build"]


@pytest.mark.slow
def test_cuda_build_compiles_without_a_gpu():
    if jit.find_cuda_home() is None:
        pytest.skip("no nvcc on this machine")
    t0 = time.perf_counter()
    info = jit.compile_cuda_only()
    assert info["library"].endswith(".so")
    import os

    assert os.path.getsize(info["library"]) > 0
    print(f"CUDA ring build: {time.perf_counter() - t0:.1f} s (cached={info['cached']})")
    assert jit.build_report()["cuda"]["cached"]
    # One process may hold both builds (the bindings they share must not collide in pybind11's
    # global registry); importing the CUDA build needs no GPU, only its runtime library.
    import subprocess
    import sys

    code = (
        "import importlib.util; from megatron.core.dmi.transport import jit; jit.load_host(); "
        f"spec = importlib.util.spec_from_file_location({info['name']!r}, {info['library']!r}); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "print(m.SpoolThread.__name__, m.ROUTER_SELECT_MAX_K)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["SpoolThread", "32"]
