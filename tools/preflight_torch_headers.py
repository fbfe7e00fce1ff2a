"""Pre-flight for a GPU machine with an older torch: compile the torch binding sources against ANOTHER torch's
headers (the GPU machine has torch 2.11; this project builds against 2.14), so an API newer than
that torch can never break the one GPU build we get.

Takes the exact compile commands of the binding sources (``cpp/torch/*.cpp``, for ``_C`` and
``_sim``) from the project's ninja build (``ninja -t compdb``), swaps the torch include directories
for the other torch's (unpacked from its wheel: only ``torch/include``), and runs them with
``-fsyntax-only``. Only the ``.cpp`` bindings include torch; the kernels never do.

    python tools/preflight_torch_headers.py --wheel .venv/preflight/torch-2.11.0-*.whl \\
        --build-dir build
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile


def unpack_headers(wheel: str, dest: str) -> str:
    """``dest/torch/include`` from the wheel (unpacked once; a stamp file names the wheel)."""
    stamp = os.path.join(dest, ".from")
    inc = os.path.join(dest, "torch", "include")
    if os.path.isfile(stamp) and open(stamp).read() == os.path.basename(wheel) and os.path.isdir(inc):
        return inc
    shutil.rmtree(dest, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("torch/include/"):
                z.extract(name, dest)
    with open(stamp, "w") as f:
        f.write(os.path.basename(wheel))
    return inc


def binding_commands(build_dir: str):
    if not os.path.isfile(os.path.join(build_dir, "build.ninja")):  # e.g. build/ holding build/<wheel tag>/
        found = sorted(glob.glob(os.path.join(build_dir, "*", "build.ninja")), key=os.path.getmtime)
        if not found:
            raise SystemExit(f"preflight: no build.ninja in or below {build_dir!r} (run make install first)")
        build_dir = os.path.dirname(found[-1])
    ninja = shutil.which("ninja", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if ninja is None:
        raise SystemExit("preflight: ninja not found (pip install ninja)")
    out = subprocess.run([ninja, "-C", build_dir, "-t", "compdb"], check=True, capture_output=True, text=True).stdout
    return [e for e in json.loads(out) if "/cpp/torch/" in e["file"] and e["file"].endswith(".cpp")]


def rewrite(command: str, new_include: str) -> list:
    """The compile command with the torch include dirs replaced, no object output, syntax only."""
    args = shlex.split(command)
    out, skip = [], 0
    for i, a in enumerate(args):
        if skip:
            skip -= 1
            continue
        if a in ("-o", "-MT", "-MF"):
            skip = 1
            continue
        if a == "-MD":
            continue
        m = re.match(r"^(.*)/torch/include(/torch/csrc/api/include)?$", a)
        if m and i > 0 and args[i - 1] in ("-isystem", "-I"):
            a = new_include + (m.group(2) or "")
        out.append(a)
    return out + ["-fsyntax-only"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", required=True, help="the other torch's wheel (a glob is fine)")
    ap.add_argument("--build-dir", required=True, help="the project's ninja build directory (or its parent)")
    ap.add_argument("--dest", default=None, help="where to unpack the headers (default: beside the wheel)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args(argv)
    wheels = sorted(glob.glob(args.wheel))
    if not wheels:
        raise SystemExit(f"preflight: no wheel matches {args.wheel!r}")
    wheel = wheels[-1]
    dest = os.path.abspath(args.dest or os.path.join(os.path.dirname(wheel), "unpacked"))
    inc = unpack_headers(wheel, dest)
    vh = open(os.path.join(inc, "torch", "headeronly", "version.h")).read()
    version = ".".join(re.search(rf"TORCH_VERSION_{k} (\d+)", vh).group(1) for k in ("MAJOR", "MINOR", "PATCH"))
    cmds = binding_commands(args.build_dir)
    if not cmds:
        raise SystemExit(f"preflight: no cpp/torch compile commands in {args.build_dir} (build first)")
    print(f"preflight: {len(cmds)} binding sources against torch {version} headers "
          f"({os.path.basename(wheel)})", flush=True)
    t0 = time.time()

    def run(e):
        r = subprocess.run(rewrite(e["command"], inc), cwd=e["directory"], capture_output=True, text=True)
        return e["file"], r.returncode, r.stderr

    failed = []
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for file, rc, err in pool.map(run, cmds):
            print(f"  {'ok  ' if rc == 0 else 'FAIL'} {os.path.relpath(file)}", flush=True)
            if rc != 0:
                failed.append((file, err))
    for file, err in failed:
        print(f"\n--- {file}\n{err[-4000:]}", file=sys.stderr)
    print(f"preflight: {len(cmds) - len(failed)}/{len(cmds)} compile, {time.time() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
