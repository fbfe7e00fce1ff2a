"""Unpack the CUTLASS/CuTe headers of the pinned `nvidia-cutlass` wheel into DEST/include.

Used by the Makefile instead of `pip install nvidia-cutlass`: only the headers are needed, and
installing the wheel would pull in (or complain about) its Python dependencies. Nothing is
vendored: the wheel comes from PyPI by name and version.

    python third_party/cutlass_headers.py DEST   # prints DEST (use as CUTLASS_DIR)
"""

import glob
import os
import subprocess
import sys
import zipfile

VERSION = "4.2.0"
PREFIX = "cutlass_library/source/include/"


def main(dest: str) -> None:
    marker = os.path.join(dest, "include", "cutlass", "cutlass.h")
    if not os.path.exists(marker):
        wheels = os.path.join(dest, "wheel")
        found = glob.glob(os.path.join(wheels, f"nvidia_cutlass-{VERSION}*.whl"))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "-d", wheels, f"nvidia-cutlass=={VERSION}"], check=True)
            found = glob.glob(os.path.join(wheels, f"nvidia_cutlass-{VERSION}*.whl"))
        with zipfile.ZipFile(found[0]) as wheel:
            for info in wheel.infolist():
                if info.filename.startswith(PREFIX) and not info.is_dir():
                    target = os.path.join(dest, "include", info.filename[len(PREFIX):])
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with wheel.open(info) as src, open(target, "wb") as out:
                        out.write(src.read())
    print(os.path.abspath(dest))


if __name__ == "__main__":
    main(sys.argv[1])
