"""Shared pytest machinery for fastinfer.

Backends
--------
Parity tests are parametrised over three *backends* that run the same op schemas:

* ``cpu``  -- ``torch.ops.fastinfer.*`` on CPU tensors (ATen C++ impls): float32/float16/bfloat16;
* ``sim``  -- ``torch.ops.fastinfer_sim.*``: the real CUDA kernel sources executed by the
  ``cpp/simt`` emulator on CPU tensors (float16/bfloat16). Every sim call is made twice, with
  ``FASTINFER_SIMT_SEED=1`` and ``=2`` (two different thread schedules), and the two results must be
  bit-identical: a data race or a schedule-dependent reduction shows up as a difference;
* ``cuda`` -- ``torch.ops.fastinfer.*`` on CUDA tensors; marked ``@pytest.mark.cuda`` and skipped
  when no GPU is present.

Error rule (FlashAttention's)
-----------------------------
An output ``out`` is compared against the fp64 oracle ``ref`` (``fastinfer.reference``) and against
``naive``: the same computation written in plain torch and executed *in the input precision*
(bf16 ops for bf16 inputs, ...). We require

* ``rel = ||out - ref||_2 / ||ref||_2 <= rel_tol(dtype)`` (a loose sanity bound), and
* ``max|out - ref| <= 2 * max|naive - ref| + floor`` (``floor`` ~ 1e-6 absolute),

i.e. the kernel may not be more than twice as wrong as the obvious implementation in the same
precision. Kernels compute in fp32 and round once, so they normally sit well inside this bound.
See :func:`assert_fa_close`.

Hygiene: inputs are random normal (never zeros); outputs and caches are poisoned (NaN or a
sentinel bit pattern) before an op writes them, so a missing write cannot pass by accident.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import pytest
import torch

SEED_ENV = "FASTINFER_SIMT_SEED"
SIM_SEEDS = (1, 2)


# --------------------------------------------------------------------------------------------
# pytest hooks
# --------------------------------------------------------------------------------------------


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "sim: runs CUDA kernel sources in the simt emulator")
    config.addinivalue_line("markers", "compile: torch.compile tests (slow)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU available")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def cpu_auto_dtype_is_float32():
    """``dtype="auto"`` on a CPU resolves to float32 in every test, whatever this CPU is: the CPU's
    auto is bfloat16 where it computes bfloat16 natively (:func:`fastinfer.cpu_has_native_bf16`),
    and a suite whose models change precision with the machine it runs on would not be
    deterministic. Tests that need bfloat16 ask for it; ``tests/test_engine_config.py`` tests the
    detection and both outcomes of the rule by patching it themselves. Session-scoped, so that it
    is in place before any module's engines are built. Processes a test starts (``fastinfer
    serve``, torchrun) do not see it: they are given ``--dtype`` explicitly."""
    try:
        fi = _import_fastinfer()
    except ImportError:  # not built: the tests that need it say so themselves
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fi, "cpu_has_native_bf16", lambda cpuinfo="/proc/cpuinfo": False)
        yield


# --------------------------------------------------------------------------------------------
# library loading
# --------------------------------------------------------------------------------------------


def _import_fastinfer():
    import fastinfer  # noqa: F401  (loads the extension, registers torch.ops.fastinfer)

    return fastinfer


@pytest.fixture(scope="session")
def fastinfer_mod():
    return _import_fastinfer()


_SIM_STATE: dict = {}


def sim_available() -> bool:
    """True when the simt build of the kernels (``torch.ops.fastinfer_sim``) can be loaded."""
    if "ok" not in _SIM_STATE:
        ok = False
        try:
            fi = _import_fastinfer()
            avail = getattr(fi, "sim_available", None)
            if avail is None or avail():
                import fastinfer._sim  # noqa: F401

                ok = True
        except Exception as e:  # pragma: no cover - depends on the build
            _SIM_STATE["why"] = f"{type(e).__name__}: {e}"
        _SIM_STATE["ok"] = ok
    return _SIM_STATE["ok"]


def require_sim():
    if not sim_available():
        pytest.skip(f"fastinfer_sim not available ({_SIM_STATE.get('why', 'not built')})")


@contextlib.contextmanager
def sim_seed(seed: int):
    """Set ``FASTINFER_SIMT_SEED`` for the duration of the block (read by every sim launch)."""
    old = os.environ.get(SEED_ENV)
    os.environ[SEED_ENV] = str(seed)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(SEED_ENV, None)
        else:
            os.environ[SEED_ENV] = old


# --------------------------------------------------------------------------------------------
# backends
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    name: str  # "cpu" | "sim" | "cuda"
    ns_name: str  # "fastinfer" | "fastinfer_sim"
    device: str  # "cpu" | "cuda"

    @property
    def ns(self):
        return getattr(torch.ops, self.ns_name)

    @property
    def is_sim(self) -> bool:
        return self.name == "sim"

    def run(self, fn: Callable[[], Sequence[torch.Tensor]]):
        """Call ``fn`` (which must build fresh inputs, run the op and return its outputs).

        For the sim backend ``fn`` runs once per schedule seed and all results must be
        bit-identical; the first result is returned.
        """
        if not self.is_sim:
            return fn()
        results = []
        for seed in SIM_SEEDS:
            with sim_seed(seed):
                results.append(fn())
        first = results[0]
        single = isinstance(first, torch.Tensor)
        for other in results[1:]:
            a_list = [first] if single else list(first)
            b_list = [other] if single else list(other)
            for i, (a, b) in enumerate(zip(a_list, b_list)):
                assert torch.equal(raw_bits(a), raw_bits(b)), (
                    f"sim output {i} differs between schedule seeds {SIM_SEEDS}: "
                    "race or schedule-dependent arithmetic"
                )
        return first


BACKENDS = {
    "cpu": Backend("cpu", "fastinfer", "cpu"),
    "sim": Backend("sim", "fastinfer_sim", "cpu"),
    "cuda": Backend("cuda", "fastinfer", "cuda"),
}

BACKEND_DTYPES = {
    "cpu": (torch.float32, torch.float16, torch.bfloat16),
    "sim": (torch.float16, torch.bfloat16),
    "cuda": (torch.float16, torch.bfloat16),
}


def get_backend(name: str) -> Backend:
    """Return the backend, skipping the test when it cannot run here."""
    _import_fastinfer()
    if name == "sim":
        require_sim()
    elif name == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU available")
    return BACKENDS[name]


def backend_params(cases: dict, dtypes: Optional[dict] = None):
    """Expand ``{"cpu": [case, ...], "sim": [...], "cuda": [...]}`` into pytest params.

    Each param is ``(backend_name, dtype, *case)``; sim params get ``@pytest.mark.sim``, cuda
    params ``@pytest.mark.cuda``. ``dtypes`` overrides :data:`BACKEND_DTYPES` per backend.
    """
    dtypes = dict(BACKEND_DTYPES, **(dtypes or {}))
    out = []
    for bname, blist in cases.items():
        marks = {"sim": [pytest.mark.sim], "cuda": [pytest.mark.cuda]}.get(bname, [])
        for dt in dtypes[bname]:
            for case in blist:
                case = tuple(case) if isinstance(case, (tuple, list)) else (case,)
                cid = "-".join([bname, str(dt).replace("torch.", "")] + [_idstr(c) for c in case])
                out.append(pytest.param(bname, dt, *case, marks=marks, id=cid))
    return out


def _idstr(c) -> str:
    if isinstance(c, torch.dtype):
        return str(c).replace("torch.", "")
    if isinstance(c, (tuple, list)):
        return "x".join(_idstr(e) for e in c)
    return str(c)


# --------------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------------


def make_gen(seed: int = 0) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def randn(shape, dtype, device="cpu", gen=None, scale=1.0, offset=0.0) -> torch.Tensor:
    """Random normal values (generated in fp32 on CPU, then cast and moved): never all-zero."""
    t = torch.randn(shape, generator=gen, dtype=torch.float32) * scale + offset
    return t.to(dtype=dtype).to(device)


_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bit pattern as an integer tensor on CPU (for bit-exact comparisons)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if not (t.is_floating_point() or t.is_complex()):
        return t
    return t.view(_BITS_VIEW[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, msg: str = ""):
    assert a.shape == b.shape, f"{msg}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{msg}: dtype {a.dtype} != {b.dtype}"
    ba, bb = raw_bits(a), raw_bits(b)
    if not torch.equal(ba, bb):
        bad = (ba != bb).nonzero()
        n = bad.shape[0]
        first = tuple(bad[0].tolist())
        raise AssertionError(
            f"{msg}: {n} elements differ bitwise; first at {first}: "
            f"{a.cpu()[first].item()!r} vs {b.cpu()[first].item()!r}"
        )


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised-looking tensor shaped like ``t``: NaN for floats (0x7F NaN for fp8)."""
    return poison_(torch.empty_like(t))


# one fixed quiet-NaN bit pattern per dtype (filling with float("nan") does not give a stable
# pattern across dtypes/vectorised paths, and the untouched-row checks compare raw bits)
POISON_BITS = {
    torch.float8_e4m3fn: 0x7F,
    torch.float16: 0x7E00,
    torch.bfloat16: 0x7FC0,
    torch.float32: 0x7FC00000,
    torch.float64: 0x7FF8000000000000,
}


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with a NaN of a fixed bit pattern (:data:`POISON_BITS`)."""
    if t.dtype in POISON_BITS:
        t.view(_BITS_VIEW[t.element_size()]).fill_(POISON_BITS[t.dtype])
    else:
        t.fill_(-12345)
    return t


# --------------------------------------------------------------------------------------------
# error rule
# --------------------------------------------------------------------------------------------

REL_TOL = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.2e-2,
}


def assert_fa_close(
    out: torch.Tensor,
    ref: torch.Tensor,
    naive: torch.Tensor,
    *,
    rel_tol: Optional[float] = None,
    floor: float = 1e-6,
    name: str = "out",
):
    """FlashAttention's error rule (see module docstring).

    Args:
        out: the implementation's output (any float dtype, any device).
        ref: the fp64 oracle result.
        naive: the same computation in plain torch in the input precision.
        rel_tol: bound on ``||out - ref|| / ||ref||``; default from :data:`REL_TOL` by ``out.dtype``.
        floor: absolute slack added to ``2 * max|naive - ref|``.
    """
    assert tuple(out.shape) == tuple(ref.shape), f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if rel_tol is None:
        rel_tol = REL_TOL.get(out.dtype, 1e-5)
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    nv = naive.detach().to("cpu", torch.float64)
    if o.numel() == 0:
        return
    nonfinite = (~torch.isfinite(o)).sum().item()
    assert nonfinite == 0, f"{name}: {nonfinite} non-finite outputs (unwritten or overflow)"
    assert torch.isfinite(r).all(), f"{name}: reference is not finite (bad test inputs)"
    err = (o - r).abs()
    rel = ((o - r).norm() / r.norm().clamp_min(1e-300)).item()
    naive_err = (nv - r).abs().max().item()
    bound = 2.0 * naive_err + floor
    max_err = err.max().item()
    where = tuple((err == err.max()).nonzero()[0].tolist())
    assert rel <= rel_tol, f"{name}: relative error {rel:.3e} > {rel_tol:.1e}"
    assert max_err <= bound, (
        f"{name}: max abs error {max_err:.3e} at {where} (out={o[where].item()!r}, "
        f"ref={r[where].item()!r}) > 2 * naive error {naive_err:.3e} + {floor:.0e}"
    )


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """One intra-op thread for a module of tiny-model tests (``pytestmark =
    pytest.mark.usefixtures("one_intra_op_thread")``): on a loaded 2-core machine two OpenMP threads
    that wait for each other made a tiny decode step 50-100x slower (measured 31 s vs 0.6 s for the
    speculative-decoding module). Restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def engines():
    """Makes LLMs; shuts every one down at teardown (pass or fail)."""
    from fastinfer import LLM

    made = []

    def make(*args, **kw):
        llm = LLM(*args, **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()
