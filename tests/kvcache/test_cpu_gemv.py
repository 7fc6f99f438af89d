"""The native float32 GEMV (``csrc/gemv.cpp``): one or two rows against a float64 reference.

Skips, saying why, only where no C++ compiler exists; a failed build with one fails (``tests.kvcache.native``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcache import cpu_kernels
from kvcache.cpu_kernels import Gemv
from tests.kvcache.native import require_native

TOLERANCE = 1e-5  # error relative to sum_k |x_k w_k| (+ |b|), the scale of a dot product's rounding


@pytest.fixture(scope="module")
def gemv() -> Gemv:
    return require_native(cpu_kernels.get_gemv)


def relative_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    """Largest |got - exact| over the magnitude sum behind each output, exact in float64."""
    x64, w64 = x.double(), w.double()
    want, scale = x64 @ w64.T, x64.abs() @ w64.abs().T
    if b is not None:
        want, scale = want + b.double(), scale + b.double().abs()
    return float(((got.double() - want).abs() / scale.clamp_min(1e-30)).max())


# Odd K exercise every vector path's tail (16-wide masked, 8-wide then scalar); odd N the row tail
# after blocks of four rows; 576 and 1536 are SmolLM2-135M's.
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(1, 1), (3, 7), (5, 15), (4, 16), (17, 17), (33, 31), (64, 100),
                                 (333, 1000), (576, 576), (96, 1536)])
def test_matches_float64_reference(gemv: Gemv, rows: int, bias: bool, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    w, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    out = torch.full((rows, n), float("nan"))
    gemv(out, x, w, b)
    assert relative_error(out, x, w, b) <= TOLERANCE


def test_rows_are_independent_and_threads_change_nothing(gemv: Gemv) -> None:
    """Each output row is its own activation row's product, bit for bit, whatever the thread count."""
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(203, 77, generator=gen), torch.randn(2, 77, generator=gen)
    both, alone = torch.empty(2, 203), torch.empty(1, 203)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))  # a team, whatever the suite's one-thread fixture set
        gemv(both, x, w, None)
        gemv(alone, x[1:].contiguous(), w, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(both[1:], alone)
    try:
        torch.set_num_threads(1)
        one = torch.empty(2, 203)
        gemv(one, x, w, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, both)


Make = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


@pytest.mark.parametrize("what,make", [
    ("x", lambda o, x, w, b: (o, x.double(), w, b)),
    ("x", lambda o, x, w, b: (torch.empty(3, 8), torch.randn(3, 16), w, b)),  # three rows
    ("x", lambda o, x, w, b: (o, torch.randn(16, 2).T, w, b)),  # not contiguous
    ("weight", lambda o, x, w, b: (o, x, torch.randn(8, 15), b)),  # K differs
    ("out", lambda o, x, w, b: (torch.empty(1, 9), x, w, b)),
    ("bias", lambda o, x, w, b: (o, x, w, torch.randn(7))),
])
def test_rejects_bad_inputs(gemv: Gemv, what: str, make: Make) -> None:
    out, x, w, b = make(torch.empty(2, 8), torch.randn(2, 16), torch.randn(8, 16), torch.randn(8))
    with pytest.raises(RuntimeError, match=f"gemv_f32: {what} must be"):
        gemv(out, x, w, b)


def test_reports_the_vector_path_of_its_build(gemv: Gemv) -> None:
    """-march=native picks AVX-512 or AVX2 + FMA by the CPU's flags; the generic build has neither."""
    module = cpu_kernels.load_extension()
    assert module is not None
    if not module.__name__.endswith("_native"):
        assert cpu_kernels.gemv_isa() == "scalar"
        return
    try:
        flags = set(Path("/proc/cpuinfo").read_text(encoding="utf-8").split())
    except OSError:
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    want = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "scalar"
    assert cpu_kernels.gemv_isa() == want
