"""The C++ embedding example (tests/cpp) configures against the installed CMake package, builds,
and runs: on the CPU through simt always, on the GPU when there is one."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

import fastinfer

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def built_example(tmp_path_factory):
    build = tmp_path_factory.mktemp("cpp-build")
    generator = ["-G", "Ninja"] if shutil.which("ninja") or os.path.exists(os.path.join(os.path.dirname(sys.executable), "ninja")) else []
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(
        ["cmake", "-S", os.path.join(HERE, "cpp"), "-B", str(build), *generator,
         f"-DCMAKE_PREFIX_PATH={fastinfer.cmake_prefix_path}", "-DCMAKE_BUILD_TYPE=Release"],
        capture_output=True, text=True, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run(["cmake", "--build", str(build)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return build


def test_cpp_example_runs_on_cpu_through_simt(built_example):
    proc = subprocess.run([str(built_example / "example_simt")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cpp_example_runs_on_gpu(built_example):
    exe = built_example / "example_cuda"
    assert exe.exists(), "the package was built without CUDA kernels"
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
