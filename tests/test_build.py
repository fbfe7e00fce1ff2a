"""Build checks: the compiled CUDA kernels carry sm_80 and sm_90a code and none spills registers or
uses a stack frame (from the ptxas -v report kept at build time, and cuobjdump when installed)."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import fastinfer

PKG_DIR = os.path.dirname(importlib.util.find_spec("fastinfer").origin)
REPORT = os.path.join(PKG_DIR, "ptxas_report.txt")
BUILT_WITH_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("fastinfer::rms_norm", "CUDA")
needs_cuda_build = pytest.mark.skipif(not BUILT_WITH_CUDA, reason="extension built without CUDA kernels")
# The architectures the default build has SASS for (FASTINFER_CUDA_ARCHS in CMakeLists.txt): the
# main ones, which must not spill, and the newer ones for the kernels that compile there.
MAIN_ARCHS = {"sm_80", "sm_89", "sm_90a"}
NEWER_ARCHS = {"sm_100a", "sm_120a"}
REQUIRED_ARCHS = MAIN_ARCHS | NEWER_ARCHS
PTX_ARCH = "sm_89"  # the PTX embedded for GPUs newer than every SASS (JIT-compiled by the driver)
# Spills on the newer architectures, known and accepted (the kernels there are the mma.sync ones,
# tuned for sm_80 .. sm_90): kernel-name substring -> arch.
NEWER_ARCH_SPILLS: dict[str, str] = {}


def parse_ptxas_report(text):
    """{(kernel, arch): {"stack": int, "spill_stores": int, "spill_loads": int, "registers": int}}"""
    entries, current = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", line)
        if m:
            current = (m.group(1), m.group(2))
            entries[current] = {}
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            entries[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            entries[current]["registers"] = int(m.group(1))
    return entries


def test_parse_ptxas_report_finds_spills():
    text = (
        "ptxas info    : Compiling entry function '_Z1kv' for 'sm_80'\n"
        "ptxas info    : Function properties for _Z1kv\n"
        "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 0 barriers\n"
    )
    assert parse_ptxas_report(text) == {
        ("_Z1kv", "sm_80"): {"stack": 8, "spill_stores": 4, "spill_loads": 4, "registers": 255}
    }


def ptxas_entries():
    assert os.path.exists(REPORT), f"{REPORT} missing: the build must keep the ptxas -v report"
    entries = parse_ptxas_report(open(REPORT).read())
    assert entries, "no kernel found in the ptxas report"
    return entries


@needs_cuda_build
def test_no_kernel_spills_registers():
    # Whatever architectures this build has (a one-architecture build while iterating included).
    entries = ptxas_entries()
    bad = {key: v for key, v in entries.items() if v.get("stack", 1) or v.get("spill_stores", 1) or v.get("spill_loads", 1)}
    accepted = {(k, a) for k, a in bad if any(sub in k and arch == a for sub, arch in NEWER_ARCH_SPILLS.items())}
    bad = {key: v for key, v in bad.items() if key not in accepted}
    assert not bad, "kernels with a stack frame or register spills:\n" + "\n".join(f"{k} {a}: {v}" for (k, a), v in bad.items())
    assert all(a in NEWER_ARCHS for _, a in accepted)


@needs_cuda_build
def test_every_kernel_built_for_required_archs():
    entries = ptxas_entries()
    kernels = {k for k, _ in entries}
    archs = {a for _, a in entries}
    assert REQUIRED_ARCHS <= archs, f"built for {sorted(archs)}, need {sorted(REQUIRED_ARCHS)}"
    sm90_only = sm90_only_kernels(open(REPORT).read())
    missing = [(k, a) for k in kernels for a in REQUIRED_ARCHS if (k, a) not in entries and k not in sm90_only]
    assert not missing, f"kernels without code for an arch: {missing[:5]}"


def find_cuobjdump():
    spec = importlib.util.find_spec("nvidia")
    for base in list(spec.submodule_search_locations) if spec else []:
        for sub in ("cu13/bin/cuobjdump", "cuda_cuobjdump/bin/cuobjdump"):
            path = os.path.join(base, sub)
            if os.path.exists(path):
                return path
    return shutil.which("cuobjdump")


@needs_cuda_build
def test_extension_contains_every_arch_cubin_and_one_ptx():
    tool = find_cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump)")
    ext = importlib.util.find_spec("fastinfer._C").origin
    listing = subprocess.run([tool, "--list-elf", ext], capture_output=True, text=True, check=True).stdout
    found = set(re.findall(r"\.(sm_\d+a?)\.cubin", listing))
    assert REQUIRED_ARCHS <= found, f"cubins in {ext}: {sorted(found)}"
    ptx = subprocess.run([tool, "--list-ptx", ext], capture_output=True, text=True, check=True).stdout
    assert set(re.findall(r"\.(sm_\d+a?)\.ptx", ptx)) == {PTX_ARCH}, ptx[:500]
    usage = subprocess.run([tool, "--dump-resource-usage", ext], capture_output=True, text=True, check=True).stdout
    # each cubin's "Function <name>:" / "REG:.. STACK:.." lines follow its "arch = sm_XX" header
    stacks, arch = [], None
    for line in usage.splitlines():
        m = re.search(r"arch = (sm_\d+a?)", line)
        if m:
            arch = m.group(1)
        m = re.search(r"STACK:(\d+)", line)
        if m and arch in MAIN_ARCHS:
            stacks.append(int(m.group(1)))
    assert stacks and max(stacks) == 0, "a kernel uses a stack frame:\n" + usage[:2000]


# ---------------------------------------------------------------------------------------------
# Hopper-only kernels: cuda/src/*_sm90.cu (CUTLASS 3.x TMA + wgmma) are compiled for sm_90a alone.
SM90_ONLY_SOURCE = "_sm90.cu"
FP8_SM90_SOURCE = "fp8_gemm_sm90.cu"
INT8_SM90_SOURCE = "int8_gemm_sm90.cu"
SM90_MIN_KERNELS = 6  # per source: 3 tile configurations x 2 output dtypes


def is_cutlass_fp8_gemm(kernel):
    # cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<..., float_e4m3_t, ...>>
    return "GemmUniversal" in kernel and "float_e4m3_t" in kernel


def is_cutlass_int8_gemm(kernel):
    # cutlass::device_kernel<GemmUniversal<... TiledMMA<MMA_Atom<SM90_64xNx32_S32S8S8_SS_TN> ...>>>
    return "GemmUniversal" in kernel and "S32S8S8" in kernel


# (source, which kernels it must hold): each sm_90a-only W8A8 GEMM source.
SM90_GEMMS = [(FP8_SM90_SOURCE, is_cutlass_fp8_gemm), (INT8_SM90_SOURCE, is_cutlass_int8_gemm)]
SM90_IDS = ["fp8", "int8"]


def report_sections(text):
    """Split the ptxas report into {object-file header: section text} ("# <path>.ptxas" lines)."""
    sections, name = {}, None
    for line in text.splitlines():
        if line.startswith("# "):
            name = line[2:]
            sections[name] = []
        elif name is not None:
            sections[name].append(line)
    return {k: "\n".join(v) for k, v in sections.items()}


def sm90_only_kernels(text, source=SM90_ONLY_SOURCE):
    """Kernels compiled from the sm_90a-only sources (objects named like *_sm90.cu.o)."""
    kernels = set()
    for name, body in report_sections(text).items():
        if source in name:
            kernels |= {k for k, _ in parse_ptxas_report(body)}
    return kernels


def test_sm90_only_kernels_found_by_object_name():
    text = (
        "# /b/CMakeFiles/fastinfer_kernels.dir/cuda/src/norm.cu.o.ptxas\n"
        "ptxas info    : Compiling entry function '_Z4normv' for 'sm_80'\n"
        "# /b/CMakeFiles/fastinfer_kernels_sm90.dir/cuda/src/fp8_gemm_sm90.cu.o.ptxas\n"
        "ptxas info    : Compiling entry function '_Z4gemmv' for 'sm_90a'\n"
    )
    assert sm90_only_kernels(text) == {"_Z4gemmv"}
    assert sm90_only_kernels(text, FP8_SM90_SOURCE) == {"_Z4gemmv"}


@needs_cuda_build
@pytest.mark.parametrize("source,is_gemm", SM90_GEMMS, ids=SM90_IDS)
def test_sm90_gemm_kernels_in_ptxas_report_sm90a_only_without_spills(source, is_gemm):
    assert os.path.exists(REPORT), f"{REPORT} missing: the build must keep the ptxas -v report"
    text = open(REPORT).read()
    kernels = sm90_only_kernels(text, source)
    assert len(kernels) >= SM90_MIN_KERNELS, (
        f"{source}: {len(kernels)} kernels in the ptxas report, expected >= {SM90_MIN_KERNELS} "
        "(it compiles to stubs unless 90a is in FASTINFER_CUDA_ARCHS and CUTLASS headers are found)"
    )
    entries = parse_ptxas_report(text)
    for k in kernels:
        assert is_gemm(k), f"unexpected kernel in {source}: {k[:200]}"
        archs = {a for kk, a in entries if kk == k}
        assert archs == {"sm_90a"}, f"{k[:120]}... built for {sorted(archs)}, expected sm_90a only"
        v = entries[(k, "sm_90a")]
        assert v.get("registers", 0) > 0, f"{k[:120]}: no register count in the report"
        assert (v.get("stack", 1), v.get("spill_stores", 1), v.get("spill_loads", 1)) == (0, 0, 0), (
            f"{k[:120]}...: {v}"
        )


def test_sm90_gemm_kernel_names_tell_fp8_from_int8():
    # Prefixes of the real names (ptxas report, CUTLASS 4.2): the operand types show in the wgmma atom.
    head = ("_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalIN4cute5tupleIJiiiiEEENS1_10collective13"
            "CollectiveMmaINS1_34MainloopSm90TmaGmmaWarpSpecializedILi13ENS5_IJNS4_1CILi1EEENSA_ILi4EEESB_EEENS1_")
    int8 = head + ("32KernelTmaWarpSpecializedPingpongEEENS5_IJNSA_ILi64EEESG_NSA_ILi128EEEEEEaNS5_IJlSB_lEEEaSJ_NS4_8"
                   "TiledMMAINS4_8MMA_AtomIJNS4_4SM904GMMA26MMA_64x64x32_S32S8S8_SS_TNEEEE")
    fp8 = head + ("44KernelTmaWarpSpecializedPingpongFP8FastAccumEEENS5_IJNSA_ILi64EEESG_NSA_ILi128EEEEEENS_12"
                  "float_e4m3_tENS5_IJlSB_lEEESJ_SK_NS4_8TiledMMAINS4_8MMA_AtomIJNS4_4SM904GMMA30"
                  "MMA_64x64x32_F32E4M3E4M3_SS_TNILNSO_7ScaleInE1ELSQ_1EEEEE")
    assert is_cutlass_fp8_gemm(fp8) and not is_cutlass_int8_gemm(fp8)
    assert is_cutlass_int8_gemm(int8) and not is_cutlass_fp8_gemm(int8)


def parse_resource_usage(text):
    """cuobjdump --dump-resource-usage -> [(kind 'elf'|'ptx', arch, source, {function: {REG, STACK, LOCAL}})]."""
    sections = []
    for block in re.split(r"^Fatbin (?=elf code:|ptx code:)", text, flags=re.M)[1:]:
        kind = block.split(" ", 1)[0]
        arch = re.search(r"^arch = (\S+)", block, re.M)
        ident = re.search(r"^identifier = (\S+)", block, re.M)
        funcs = {}
        for m in re.finditer(r"^ Function ([^:\s]+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", block, re.M):
            funcs[m.group(1)] = {"REG": int(m.group(2)), "STACK": int(m.group(3)), "LOCAL": int(m.group(4))}
        sections.append((kind, arch.group(1) if arch else "", ident.group(1) if ident else "", funcs))
    return sections


def check_sm90_cubin(tool, path, source, is_gemm):
    usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    ours = [s for s in parse_resource_usage(usage) if s[2].endswith(source)]
    assert ours, f"no code from {source} in {path}"
    assert {(kind, arch) for kind, arch, _, _ in ours} == {("elf", "sm_90a")}, (
        f"{source} must be sm_90a SASS only, found {sorted({(k, a) for k, a, _, _ in ours})} in {path}"
    )
    funcs = {name: v for _, _, _, f in ours for name, v in f.items()}
    gemms = {name: v for name, v in funcs.items() if is_gemm(name)}
    assert len(gemms) >= SM90_MIN_KERNELS, f"GEMM kernels of {source} in the sm_90a cubin of {path}: {len(gemms)}"
    bad = {name[:120]: v for name, v in gemms.items() if v["STACK"] or v["LOCAL"]}
    assert not bad, f"{source} kernels with stack or local memory in {path}: {bad}"


def op_has_cuda_kernel(op):
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    except RuntimeError:  # the op is not registered
        return False


@needs_cuda_build
@pytest.mark.parametrize("source,is_gemm", SM90_GEMMS, ids=SM90_IDS)
def test_kernel_library_contains_sm90a_gemm_cubin(source, is_gemm):
    """The installed C++ package's fastinfer::kernels (lib/libfastinfer_kernels.a) holds the kernels
    as sm_90a SASS only, without stack or local memory; so does the extension once an op links them
    (a static library contributes only the objects something references)."""
    tool = find_cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump)")
    check_sm90_cubin(tool, os.path.join(PKG_DIR, "lib", "libfastinfer_kernels.a"), source, is_gemm)
    ext = importlib.util.find_spec("fastinfer._C").origin
    listing = subprocess.run([tool, "--list-elf", ext], capture_output=True, text=True, check=True).stdout
    op = "fastinfer::fp8_scaled_mm" if source == FP8_SM90_SOURCE else "fastinfer::int8_scaled_mm"
    if source.removesuffix(".cu") in listing or op_has_cuda_kernel(op):
        check_sm90_cubin(tool, ext, source, is_gemm)


def test_parse_resource_usage():
    text = (
        "Fatbin elf code:\n================\narch = sm_90a\ncode version = [1,8]\nhost = linux\n"
        "identifier = /src/cuda/src/fp8_gemm_sm90.cu\nResource usage:\n Common:\n  GLOBAL:0\n"
        " Function _Z1kv:\n  REG:168 STACK:0 SHARED:0 LOCAL:8 CONSTANT[0]:904 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
        "Fatbin ptx code:\n================\narch = sm_80\nidentifier = /src/cuda/src/norm.cu\n"
    )
    assert parse_resource_usage(text) == [
        ("elf", "sm_90a", "/src/cuda/src/fp8_gemm_sm90.cu", {"_Z1kv": {"REG": 168, "STACK": 0, "LOCAL": 8}}),
        ("ptx", "sm_80", "/src/cuda/src/norm.cu", {}),
    ]


def test_extensions_use_only_the_stable_torch_abi():
    """fastinfer._C / _sim / _simprof call torch through the stable C shim alone: an undefined C++
    symbol of libtorch or c10 would pin the extension to the torch it was built with."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found")
    pkg = os.path.dirname(fastinfer.__file__)
    modules = [f for f in os.listdir(pkg) if re.match(r"_(C|sim|simprof)\..*\.so$", f)]
    assert any(f.startswith("_C.") for f in modules), modules
    for name in modules:
        out = subprocess.run([nm, "-D", "--undefined-only", os.path.join(pkg, name)], capture_output=True,
                             text=True, check=True).stdout
        symbols = [line.split()[-1] for line in out.splitlines() if line.strip()]
        cxx_torch = [s for s in symbols if re.match(r"_ZN?K?(3c10|2at|5torch)", s)]
        assert not cxx_torch, f"{name} uses torch C++ symbols: {cxx_torch[:5]}"
        assert any(s.startswith("aoti_torch_") for s in symbols), name


def test_build_info_names_the_torch_it_was_built_with():
    from fastinfer import _build_info

    assert _build_info.TORCH_BUILT_WITH == torch.__version__
    major, minor = (int(x) for x in _build_info.TORCH_ABI_TARGET.split("."))
    assert (major, minor) == (2, 11)


def test_import_under_an_older_torch_names_both_versions():
    """Under a torch older than the stable-ABI target the import fails with a message naming the
    torch the extension was built with, the oldest it loads under and the running one."""
    code = ("import torch; torch.__version__ = '2.10.0'\n"
            "try:\n    import fastinfer\nexcept ImportError as e:\n    print(e)\nelse:\n    print('imported')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert f"built with torch {torch.__version__}" in out and ">= 2.11" in out and "2.10.0" in out, out
