"""Linear layers on CPU: oneDNN with prepacked weights, and the kernel for one or two rows.

On CPU, ``F.linear`` calls the BLAS torch was built with (MKL). For the small
row counts of decode steps MKL is slow on some hosts, and oneDNN with the
weight reordered once into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, then ``_linear_pointwise``, the
op torch's own compiler emits for CPU linears) is faster there
(docs/design_costs.md). vLLM's CPU backend takes the same route.

``pack`` reorders a weight once, after loading, and checks the packed
product against ``F.linear`` on a probe. The dense weight is kept beside
the packed one (the linear weights take twice their memory): for one or
two rows (``DENSE_MAX_ROWS``: batch-1 decode) oneDNN is the slower one,
and a product that streams the dense weight row by row is what runs at the
memory's bandwidth; from three rows up the packed weight is the faster one.

Which streaming product is fastest depends on the CPU: MKL's GEMV is fast on
Intel and takes a slow path on AMD, where batch-1 decode fell far behind
llama.cpp's (docs/benchmarks.md). So ``dense`` sends float32 products of one
or two rows to this process's choice (``few_rows_choice``): the native GEMV
(``kvcache/csrc/gemv.cpp``) or ``F.linear``, whichever was faster when timed
once, at load (``pack`` makes the choice). ``FLOTILLA_GEMV=native`` or
``torch`` forces one (for tests and benchmarks); forcing ``native`` where the
kernel cannot be built is an error, not a quiet ``F.linear``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvcache import cpu_kernels
from kvcache.cpu_kernels import Gemv
from scheduling.errors import InvalidParameterError

logger = logging.getLogger("flotilla.models")

ENV_SWITCH = "FLOTILLA_ONEDNN_LINEAR"
GEMV_SWITCH = "FLOTILLA_GEMV"
GEMV_MODES = ("auto", "native", "torch")
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
DENSE_MAX_ROWS = 2  # products of this many rows or fewer read the dense weight (few_rows_choice's kernel)
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # max error relative to the output's scale
# The timed product: one row through PROBE_COPIES distinct (out, in) weights, 24 MiB in all, more
# than a core's L2, so both kernels stream their weights from outside it as a decode step does.
PROBE_SHAPE = (1536, 1024)
PROBE_COPIES = 4
PROBE_ROUNDS = 5  # interleaved; each kernel's fastest round counts (other processes only add time)
_warned = False


@dataclass(frozen=True)
class GemvChoice:
    """Which kernel computes float32 products of at most ``DENSE_MAX_ROWS`` rows, and why."""

    kernel: str  # "native" (kvcache/csrc/gemv.cpp) or "torch" (F.linear: torch's BLAS, MKL on x86)
    reason: str  # "measured", "forced by FLOTILLA_GEMV", or why there is no native kernel
    isa: str | None = None  # the native kernel's vector path (avx512, avx2, scalar)
    native_ms: float | None = None  # the probe's times, when measured
    torch_ms: float | None = None
    op: Gemv | None = field(default=None, compare=False, repr=False)  # set iff kernel == "native"

    def report(self) -> dict[str, str | float | None]:
        """The choice as plain data (bench JSON)."""
        return {"kernel": self.kernel, "reason": self.reason, "isa": self.isa,
                "probe_native_ms": self.native_ms, "probe_torch_ms": self.torch_ms}


_choice: GemvChoice | None = None
_choice_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


def gemv_mode() -> str:
    """``FLOTILLA_GEMV`` (``auto`` when unset); a value outside ``GEMV_MODES`` raises."""
    mode = os.environ.get(GEMV_SWITCH, "").strip().lower() or "auto"
    if mode not in GEMV_MODES:
        raise InvalidParameterError(GEMV_SWITCH, f"must be one of {', '.join(GEMV_MODES)}, got {mode!r}")
    return mode


def choose_gemv(mode: str) -> GemvChoice:
    """The kernel for ``mode``: ``torch``, ``native`` (raises if unavailable), or ``auto``: the faster when timed."""
    forced = f"forced by {GEMV_SWITCH}"
    if mode == "torch":
        return GemvChoice("torch", forced)
    op = cpu_kernels.get_gemv()
    if op is None:
        why = (f"{cpu_kernels.ENV_SWITCH}=0" if not cpu_kernels.kernels_enabled()
               else "the native extension did not build (see the flotilla.kvcache warning)")
        if mode == "native":
            raise InvalidParameterError(GEMV_SWITCH, f"native GEMV forced but unavailable: {why}")
        return GemvChoice("torch", f"no native kernel: {why}")
    isa = cpu_kernels.gemv_isa()
    if mode == "native":
        return GemvChoice("native", forced, isa, op=op)
    native_ms, torch_ms = _time_probe(op)
    if native_ms <= torch_ms:
        return GemvChoice("native", "measured", isa, native_ms, torch_ms, op)
    return GemvChoice("torch", "measured", isa, native_ms, torch_ms)


def few_rows_choice() -> GemvChoice:
    """This process's kernel for products of one or two float32 rows: chosen on the first call, then kept.

    Kept per process, not on disk: what is fastest depends on the CPU, on the
    thread count this process runs with (``--cpu-threads``), on torch's BLAS
    build and on how busy the memory is; timing it costs tens of ms once per
    process, and a cached answer would need all of those in its key.
    """
    global _choice
    with _choice_lock:
        if _choice is None:
            _choice = choose_gemv(gemv_mode())
            logger.info("1-2 row float32 products: %s (%s; isa %s; probe native %s ms, torch %s ms, %d threads)",
                        _choice.kernel, _choice.reason, _choice.isa, _choice.native_ms, _choice.torch_ms,
                        torch.get_num_threads())
        return _choice


def current_few_rows_choice() -> GemvChoice | None:
    """This process's choice if it has made one (it has once a float32 CPU model was loaded), else None."""
    return _choice


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; float32 CPU products of 1-2 rows run on ``few_rows_choice``'s kernel."""
    if (0 < x.shape[0] <= DENSE_MAX_ROWS and x.dim() == 2 and x.dtype == weight.dtype == torch.float32
            and x.device.type == "cpu" and not (torch.is_grad_enabled() and weight.requires_grad)):
        op = (_choice or few_rows_choice()).op
        if op is not None and weight.is_contiguous() and (bias is None or bias.is_contiguous()):
            out = x.new_empty(x.shape[0], weight.shape[0])
            op(out, x.contiguous(), weight, bias)
            return out
    return F.linear(x, weight, bias)


def _time_probe(op: Gemv) -> tuple[float, float]:
    """Milliseconds of one row through the probe's weights: (native, F.linear), fastest of the rounds."""
    out_features, in_features = PROBE_SHAPE
    # The values do not change either kernel's speed (no denormals); full() fills fast.
    weights = torch.full((PROBE_COPIES, out_features, in_features), 0.01)
    x, out = torch.full((1, in_features), 0.5), torch.empty(1, out_features)
    native: list[float] = []
    blas: list[float] = []
    with torch.no_grad():
        for round_ in range(PROBE_ROUNDS + 1):  # round 0 warms both up and is not counted
            t0 = time.perf_counter()
            for w in weights:
                op(out, x, w, None)
            t1 = time.perf_counter()
            for w in weights:
                F.linear(x, w)
            t2 = time.perf_counter()
            if round_:
                native.append(t1 - t0)
                blas.append(t2 - t1)
    return round(min(native) * 1e3, 3), round(min(blas) * 1e3, 3)


def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``weight`` (out, in) reordered for oneDNN, or None when it cannot or should not be.

    A float32 CPU weight also makes this process's ``few_rows_choice`` (once),
    so its timing happens at load rather than in the first decode step.
    """
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        few_rows_choice()
    if not enabled() or weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
        return None
    if not torch.backends.mkldnn.is_available() or weight.numel() == 0:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        probe = torch.randn(3, weight.shape[1], dtype=weight.dtype, generator=torch.Generator().manual_seed(0))
        want = F.linear(probe, weight, bias).float()
        got = linear(probe, packed, bias).float()
        scale = want.abs().max().clamp_min(1e-6)
        if not bool(((got - want).abs().max() / scale) <= _TOLERANCE[weight.dtype]):
            raise RuntimeError("the packed product disagrees with F.linear")
    except Exception as err:  # noqa: BLE001 - any failure keeps the dense path
        _warn_once(err)
        return None
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b`` with a weight from ``pack``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _warn_once(err: Exception) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning("oneDNN linear unavailable (%s: %s); using F.linear", type(err).__name__, err)
