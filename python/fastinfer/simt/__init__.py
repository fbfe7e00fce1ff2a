"""fastinfer.simt: compile and run complete CUDA programs on the CPU with the simt emulator.

    python -m fastinfer.simt run FILE.cu [-v] [--seed N] [-- program args]
    python -m fastinfer.simt profile FILE.cu [--json OUT] [-- program args]

``profile`` runs the profile build of the program (every load and store instrumented) and reports,
per kernel and source line, warp requests, 32-byte sectors, shared-memory wavefronts and bytes
(cpp/simt/README.md, "Profiling"); :func:`profile` does the same for a Python callable that uses
``torch.ops.fastinfer_sim``.

The program is compiled with g++ (``-std=c++20 -O1 -DFASTINFER_SIMT -include
fastinfer/simt/device.h -x c++``) against ``libfastinfer_simt.a`` and run; the exit code is the
program's. ``FASTINFER_SIMT_SEED`` selects the schedule (block order and fiber interleaving).

Headers and library are looked up in the installed package layout first
(``<fastinfer>/include``, ``<fastinfer>/lib/libfastinfer_simt.a``), then in the source tree
(``cuda/include``, ``cpp/simt/include``; the library from ``$FASTINFER_SIMT_LIB`` or built from
``cpp/simt/src`` into ``~/.cache/fastinfer/simt/<hash>/``). Compiled programs are cached by a
hash of the command line and the content of every file they depend on.

This module must not import torch.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Optional, Sequence

__all__ = [
    "SimtError",
    "cuda_include_dir",
    "include_dirs",
    "library_path",
    "compile_command",
    "compile_program",
    "run",
    "profile",
    "profile_program",
]

_PKG_DIR = Path(__file__).resolve().parent.parent  # .../fastinfer
_REPO_DIR = _PKG_DIR.parent.parent  # source tree: <repo>/python/fastinfer

CXX_FLAGS = [
    "-std=c++20",
    "-O1",
    "-g1",
    "-DFASTINFER_SIMT=1",
    "-fno-strict-aliasing",
    "-Wno-unknown-pragmas",
    "-pthread",
]
# Profile builds (`profile`): the same program with every load and store instrumented by GCC's
# ThreadSanitizer code generation, whose callbacks the simt library implements (no libtsan is
# linked), and with the ptx:: wrappers and atomics reporting themselves (FASTINFER_SIMT_PROFILE).
# -O2 (after CXX_FLAGS' -O1) keeps values in registers as nvcc would; -g1 gives the line tables and
# inline chains the report maps call sites back to source lines with.
# -fno-tree-sra keeps a load or store of a vector type (uint4, float4, float2, ...) one access of its
# width, as nvcc's LDG.128 / LDS.64 are, instead of scalar accesses of the fields that are used.
PROFILE_FLAGS = ["-O2", "-g1", "-fno-tree-sra", "-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0",
                 "-DFASTINFER_SIMT_PROFILE=1"]
LIB_FLAGS = ["-std=c++20", "-O2", "-fPIC", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
             "-DFASTINFER_SIMT=1", "-fno-strict-aliasing", "-pthread"]


class SimtError(RuntimeError):
    pass


def _cxx() -> str:
    return os.environ.get("CXX") or shutil.which("g++") or "g++"


def _cache_root() -> Path:
    base = os.environ.get("FASTINFER_SIMT_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fastinfer" / "simt"


def cuda_include_dir() -> Path:
    """CUDA headers (for __half, dim3, cuda_runtime_api.h, ...): $CUDA_HOME/include,
    /usr/local/cuda/include, then site-packages/nvidia/cu13/include."""
    cands = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]) / "include")
    cands.append(Path("/usr/local/cuda/include"))
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            cands.append(Path(p) / "nvidia" / "cu13" / "include")
    for p in sys.path:
        if p.endswith("site-packages"):
            cands.append(Path(p) / "nvidia" / "cu13" / "include")
    for c in cands:
        if (c / "cuda_runtime.h").is_file() and (c / "cuda_fp8.h").is_file():
            return c
    raise SimtError("CUDA headers not found (set CUDA_HOME, or install nvidia-cuda-runtime for cu13)")


def _installed() -> bool:
    inc = _PKG_DIR / "include"
    return (inc / "fastinfer" / "simt" / "device.h").is_file() and (
        inc / "fastinfer" / "common" / "platform.cuh").is_file()


def include_dirs() -> list[Path]:
    """Include directories for a simt program (fastinfer headers first, then CUDA)."""
    if _installed():
        dirs = [_PKG_DIR / "include"]
    else:
        dirs = [_REPO_DIR / "cuda" / "include", _REPO_DIR / "cpp" / "simt" / "include"]
        if not (dirs[1] / "fastinfer" / "simt" / "device.h").is_file():
            raise SimtError(f"fastinfer simt headers not found under {_PKG_DIR} or {_REPO_DIR}")
    return dirs + [cuda_include_dir()]


def _hash_files(h, files: Sequence[Path]) -> None:
    for f in sorted(set(files)):
        h.update(str(f).encode())
        h.update(b"\0")
        try:
            h.update(f.read_bytes())
        except OSError:
            h.update(b"<missing>")
        h.update(b"\0")


def _atomic_publish(tmp: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, dst)


def library_path(verbose: bool = False) -> Path:
    """libfastinfer_simt.a: installed copy, $FASTINFER_SIMT_LIB, or built from the source tree."""
    installed = _PKG_DIR / "lib" / "libfastinfer_simt.a"
    if installed.is_file():
        return installed
    env = os.environ.get("FASTINFER_SIMT_LIB")
    if env:
        p = Path(env)
        if not p.is_file():
            raise SimtError(f"FASTINFER_SIMT_LIB={env} does not exist")
        return p
    src_dir = _REPO_DIR / "cpp" / "simt" / "src"
    sources = sorted(list(src_dir.glob("*.cpp")) + list(src_dir.glob("*.S")))
    if not sources:
        raise SimtError(f"no simt library: neither {installed} nor sources in {src_dir}")
    incs = [_REPO_DIR / "cpp" / "simt" / "include", src_dir, cuda_include_dir()]
    h = hashlib.sha256()
    h.update(" ".join([_cxx()] + LIB_FLAGS + [str(i) for i in incs]).encode())
    _hash_files(h, sources + list(src_dir.glob("*.h")) + list((incs[0] / "fastinfer" / "simt").glob("*.h")))
    out = _cache_root() / h.hexdigest()[:20] / "libfastinfer_simt.a"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        inc_flags = [f"-I{i}" for i in incs]

        def compile_one(src: Path) -> Path:
            obj = Path(tmp) / (src.name + ".o")
            cmd = [_cxx()] + LIB_FLAGS + inc_flags + ["-c", str(src), "-o", str(obj)]
            if verbose:
                print(shlex.join(cmd), file=sys.stderr)
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise SimtError(f"building the simt library failed:\n{shlex.join(cmd)}\n{r.stderr}")
            return obj

        jobs = max(1, min(2, os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(jobs) as ex:
            objs = list(ex.map(compile_one, sources))
        lib_tmp = Path(tmp) / "libfastinfer_simt.a"
        r = subprocess.run(["ar", "rcs", str(lib_tmp)] + [str(o) for o in objs], capture_output=True, text=True)
        if r.returncode != 0:
            raise SimtError(f"ar failed: {r.stderr}")
        _atomic_publish(lib_tmp, out)
    return out


def compile_command(source: Path, output: Path, extra_flags: Sequence[str] = (), verbose: bool = False,
                    profile: bool = False) -> list[str]:
    """The compile (and link) command of a program. With ``profile`` it is the compile step only,
    to an object file (``output``); :func:`link_command` links it without the sanitizer runtime."""
    incs = [f"-I{d}" for d in include_dirs()]
    if profile:
        return ([_cxx()] + CXX_FLAGS + PROFILE_FLAGS + list(extra_flags) + incs +
                ["-include", "fastinfer/simt/device.h", "-x", "c++", str(source), "-c", "-o", str(output)])
    return ([_cxx()] + CXX_FLAGS + list(extra_flags) + incs +
            ["-include", "fastinfer/simt/device.h", "-x", "c++", str(source), "-x", "none",
             str(library_path(verbose)), "-ldl", "-rdynamic", "-o", str(output)])


def link_command(obj: Path, output: Path, verbose: bool = False) -> list[str]:
    """Links a profile-built object with libfastinfer_simt.a (which provides the instrumentation's
    callbacks); no -fsanitize here, so libtsan is not linked."""
    return [_cxx(), "-pthread", str(obj), str(library_path(verbose)), "-ldl", "-rdynamic", "-o", str(output)]


def _deps(source: Path, extra_flags: Sequence[str]) -> list[Path]:
    incs = [f"-I{d}" for d in include_dirs()]
    cmd = ([_cxx()] + CXX_FLAGS + list(extra_flags) + incs +
           ["-include", "fastinfer/simt/device.h", "-x", "c++", str(source), "-M"])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        # let the real compile report the error
        return [source]
    text = r.stdout.replace("\\\n", " ")
    _, _, deps = text.partition(":")
    return [Path(d) for d in deps.split()]


def compile_program(source, extra_flags: Sequence[str] = (), verbose: bool = False, profile: bool = False) -> Path:
    """Compile a complete CUDA program for the emulator; returns the cached executable. With
    ``profile`` the program is the profile build (instrumented loads and stores, see PROFILE_FLAGS),
    cached separately from the plain one."""
    source = Path(source).resolve()
    if not source.is_file():
        raise SimtError(f"{source}: no such file")
    lib = library_path(verbose)
    probe_cmd = compile_command(source, Path("OUT"), extra_flags, profile=profile)
    h = hashlib.sha256()
    h.update("\0".join(probe_cmd).encode())
    if profile:
        h.update("\0".join(link_command(Path("OBJ"), Path("OUT"))).encode())
    _hash_files(h, _deps(source, extra_flags) + [lib])
    out = _cache_root() / "programs" / h.hexdigest()[:24] / (source.stem + (".simtprof" if profile else ".simt"))
    cmd = compile_command(source, out, extra_flags, profile=profile)
    if verbose:
        print(shlex.join(cmd), file=sys.stderr)
        if profile:
            print(shlex.join(link_command(out.with_suffix(".o"), out)), file=sys.stderr)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
    os.close(fd)
    obj = Path(tmp + ".o")
    try:
        steps = ([compile_command(source, obj, extra_flags, profile=True), link_command(obj, Path(tmp))] if profile
                 else [compile_command(source, Path(tmp), extra_flags)])
        for step in steps:
            r = subprocess.run(step, capture_output=True, text=True)
            if r.returncode != 0:
                raise SimtError(f"compilation failed:\n{shlex.join(step)}\n{r.stderr}")
            if r.stderr and verbose:
                print(r.stderr, file=sys.stderr)
        _atomic_publish(Path(tmp), out)
    finally:
        for f in (tmp, str(obj)):
            if os.path.exists(f):
                os.unlink(f)
    return out


def run(source, args: Sequence[str] = (), seed: Optional[int] = None, verbose: bool = False,
        timeout: Optional[float] = None, capture_output: bool = False, extra_flags: Sequence[str] = ()):
    """Compile (cached) and run a program; returns subprocess.CompletedProcess."""
    exe = compile_program(source, extra_flags=extra_flags, verbose=verbose)
    env = dict(os.environ)
    if seed is not None:
        env["FASTINFER_SIMT_SEED"] = str(seed)
    return subprocess.run([str(exe)] + list(args), env=env, timeout=timeout,
                          capture_output=capture_output, text=capture_output)


def _profile_module():
    """fastinfer.simt._profile, also when this file was loaded on its own (tests load the runner
    from its path, without the package)."""
    try:
        from . import _profile as mod
    except ImportError:
        import importlib.util

        spec = importlib.util.spec_from_file_location("_fastinfer_simt_profile", Path(__file__).with_name("_profile.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    mod._compile_program = compile_program
    return mod


def profile(fn, *args, launch_only: bool = False, sample: int = 1, run_whole: Sequence[str] = (), **kwargs):
    """Memory-access profile of ``fn(*args, **kwargs)``, which calls ``torch.ops.fastinfer_sim``
    ops: see :func:`fastinfer.simt._profile.profile` (imports torch)."""
    return _profile_module().profile(fn, *args, launch_only=launch_only, sample=sample, run_whole=run_whole,
                                     **kwargs)


def profile_program(source, args: Sequence[str] = (), seed: Optional[int] = None, verbose: bool = False,
                    timeout: Optional[float] = None, capture_output: bool = False, extra_flags: Sequence[str] = ()):
    """Compile the profile build of a program, run it; returns (CompletedProcess, report or None)."""
    return _profile_module().run_profiled_program(source, args, seed=seed, verbose=verbose, timeout=timeout,
                                                  capture_output=capture_output, extra_flags=extra_flags)


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal N -> 128 + N


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    prog_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, prog_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m fastinfer.simt", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("run", help="compile FILE.cu for the emulator and run it")
    pr.add_argument("file")
    pr.add_argument("-v", "--verbose", action="store_true", help="print the compile command")
    pr.add_argument("--seed", type=int, default=None, help="schedule seed (default: $FASTINFER_SIMT_SEED or 0)")
    pr.add_argument("-X", dest="flags", action="append", default=[], help="extra compiler flag")
    pb = sub.add_parser("build", help="compile FILE.cu and print the executable's path")
    pb.add_argument("file")
    pb.add_argument("-v", "--verbose", action="store_true")
    pb.add_argument("-X", dest="flags", action="append", default=[])
    pp = sub.add_parser("profile", help="run the profile build of FILE.cu and report its memory-access counters")
    pp.add_argument("file")
    pp.add_argument("-v", "--verbose", action="store_true", help="print the compile commands")
    pp.add_argument("--seed", type=int, default=None, help="schedule seed (default: $FASTINFER_SIMT_SEED or 0)")
    pp.add_argument("-X", dest="flags", action="append", default=[], help="extra compiler flag")
    pp.add_argument("--json", default=None, help="write the report (JSON) here ('-': to stdout)")
    pp.add_argument("-q", "--quiet", action="store_true", help="no table on stdout")
    sub.add_parser("flags", help="print include dirs and the library path")
    ns = p.parse_args(argv)
    try:
        if ns.cmd == "flags":
            print(" ".join(f"-I{d}" for d in include_dirs()), library_path())
            return 0
        if ns.cmd == "build":
            print(compile_program(ns.file, ns.flags, verbose=ns.verbose))
            return 0
        if ns.cmd == "profile":
            ns.prog_args = prog_args
            return _profile_module().main_profile(ns)
        r = run(ns.file, prog_args, seed=ns.seed, verbose=ns.verbose, extra_flags=ns.flags)
        return _exit_code(r.returncode)
    except SimtError as e:
        print(f"fastinfer.simt: {e}", file=sys.stderr)
        return 125


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
