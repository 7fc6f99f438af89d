"""Native CPU kernels for the torch backend, built on first use.

``get_paged_decode`` hands out ``paged_decode``: decode attention (one query
token per sequence) that walks each sequence's page table in place, one pass
over K and V and no gather copy, on pages in the model dtype or quantized
(int8 / fp8 e4m3 with per-token, per-head scales); and ``quantize_write``,
which stores a step's k and v into quantized pages (source:
``csrc/paged_decode.cpp``). ``get_quant_gemm`` hands out the weight-only
int8/int4 products of ``actors.models.quant_linear`` (``csrc/quant_gemm.cpp``)
and ``get_gemv`` the float32 product of one or two rows that
``actors.models.cpu_linear`` may pick for batch-1 decode (``csrc/gemv.cpp``),
both built into the same module. It is
built with
``torch.utils.cpp_extension.load`` (needs a C++ compiler and ``ninja``) into
``$FLOTILLA_CACHE_DIR/torch_extensions/<variant>_v<ABI_VERSION>_<machine key>``,
so a machine builds it once (tens of seconds) and later processes only load
it. The machine key hashes the CPU model and flags (the build uses
``-march=native``), torch and Python versions, so a cache shared between
different hosts never hands one a binary built for another. Within a
directory ninja rebuilds what changed sources make stale, by file times;
``ABI_VERSION`` names the ops' signatures, so a binary cached by an older
checkout (a shared cache, a source older than its build) is never loaded
by callers passing arguments it lacks.

Nothing here may stop the engine: if the build or the load fails for any
reason, one warning goes to the ``flotilla.kvcache`` logger and callers get
``None`` (they keep their torch path). ``FLOTILLA_CPU_KERNELS=0`` turns the
kernels off.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("flotilla.kvcache")

ENV_SWITCH = "FLOTILLA_CPU_KERNELS"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
QUANTIZED_CACHE_DTYPES = (torch.int8, torch.float8_e4m3fn)
SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode.cpp"  # holds the module's bindings
QUANT_GEMM_SOURCE = SOURCE.with_name("quant_gemm.cpp")
GEMV_SOURCE = SOURCE.with_name("gemv.cpp")
_BASE_CFLAGS = ["-O3", "-fopenmp"]
# Bumped whenever an op's Python signature changes (2: paged_decode's `window`).
ABI_VERSION = 2
# Tried in order; the first that builds and loads wins.
_VARIANTS: list[tuple[str, list[str]]] = [("native", ["-march=native"]), ("generic", [])]

# (out, q, k_cache, v_cache, page_table, context_lens, scale, k_scales, v_scales, window)
PagedDecode = Callable[..., None]
# (k, v, slots, k_cache, v_cache, k_scales, v_scales)
QuantizeWrite = Callable[..., None]
# (out, x, weight, bias)
Gemv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], None]

_lock = threading.Lock()
_module: Any = None  # the loaded extension, once built
_failure: str | None = None  # why a build or load failed in this process (warned once)


def kernels_enabled() -> bool:
    """False when ``FLOTILLA_CPU_KERNELS`` is ``0`` (read on every call)."""
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


def cache_dir() -> Path:
    """``$FLOTILLA_CACHE_DIR`` or ``~/.cache/flotilla``."""
    return Path(os.environ.get("FLOTILLA_CACHE_DIR") or Path.home() / ".cache" / "flotilla").expanduser()


def _machine_key() -> str:
    """Short hash of everything a built binary depends on besides its sources and flags."""
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        wanted = ("model name", "flags")
        lines = [line for line in f.read().splitlines() if line.startswith(wanted)]
        cpu = "\n".join(sorted(set(lines)))
    parts = [platform.machine(), cpu, torch.__version__, sys.implementation.cache_tag or ""]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build_dir(variant: str) -> Path:
    """Where ``variant`` of the extension is built and cached on this machine."""
    return cache_dir() / "torch_extensions" / f"paged_decode_{variant}_v{ABI_VERSION}_{_machine_key()}"


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Exclusive across processes; the OS drops it when its holder dies.

    torch's own lock is a file that only its creator removes: a build killed
    midway would leave every later process waiting on it forever. Under this
    lock no other flotilla process is building here, so such a file is stale.
    """
    import fcntl  # POSIX only: elsewhere the ImportError means "no kernel", not a crash

    with open(directory / "flotilla.lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                logger.debug("removing stale torch extension lock %s", stale)
                stale.unlink()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """Mute torch's own build chatter: a failure is reported once, by ``load_extension``."""
    torch_logger = logging.getLogger("torch.utils.cpp_extension")
    level = torch_logger.level
    torch_logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch_logger.setLevel(level)


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """Put the ``ninja`` pip package's binary on PATH (torch runs ``ninja`` by name)."""
    try:
        import ninja

        bin_dir = str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        yield
        return
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = bin_dir + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _summary(exc: Exception) -> str:
    """One line of a build error: the compiler's first error, else the message's last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
    hits = [line for line in lines if "error:" in line or "not found" in line]
    return (hits or lines[-1:])[0][:300]


def _build() -> Any:
    """Build (or reuse) and import the extension; raises with every variant's error."""
    from torch.utils import cpp_extension

    errors: list[str] = []
    for variant, flags in _VARIANTS:
        directory = build_dir(variant)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with _build_lock(directory), _ninja_on_path(), _quiet_torch():
                return cpp_extension.load(
                    name=f"flotilla_paged_decode_{variant}",
                    sources=[str(SOURCE), str(QUANT_GEMM_SOURCE), str(GEMV_SOURCE)],
                    extra_cflags=_BASE_CFLAGS + flags,
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(directory),
                    verbose=False,
                )
        except Exception as exc:  # any failure means: no kernel, never a crash
            errors.append(f"{variant}: {type(exc).__name__}: {_summary(exc)}")
    raise RuntimeError("; ".join(errors))


def load_extension() -> Any | None:
    """The built extension module, or None when disabled or unbuildable.

    The first call in a process builds or loads it (thread-safe); a failure
    logs one warning and is remembered, so later calls return None at once.
    """
    global _module, _failure
    if not kernels_enabled():
        return None
    with _lock:
        if _module is None and _failure is None:
            try:
                _module = _build()
            except Exception as exc:
                _failure = str(exc)
                logger.warning(
                    "CPU attention kernels unavailable, using the torch path (%s); "
                    "set %s=0 to skip the build",
                    exc,
                    ENV_SWITCH,
                )
        return _module


def build_failure() -> str | None:
    """Why this process's build or load of the extension failed (each variant's first error), or None."""
    return _failure


def supports(
    device: torch.device | str, dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype | None = None
) -> bool:
    """Whether the kernels handle this pool: CPU, a supported model dtype, pages
    in it or quantized (``cache_dtype``; None: the model dtype), and a head_dim
    that is a multiple of 8 up to 256 (every common model's)."""
    cache = dtype if cache_dtype is None else cache_dtype
    return (
        torch.device(device).type == "cpu"
        and dtype in SUPPORTED_DTYPES
        and (cache == dtype or cache in QUANTIZED_CACHE_DTYPES)
        and head_dim % 8 == 0
        and 0 < head_dim <= 256
    )


def get_paged_decode(
    device: torch.device | str, dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype | None = None
) -> PagedDecode | None:
    """The ``paged_decode`` op for a pool on ``device`` in ``dtype``, or None.

    None unless ``supports(device, dtype, head_dim, cache_dtype)``, the
    kernels are enabled and the extension builds (the first call in a process
    may build it). The op's arguments are ``(out, q, k_cache, v_cache,
    page_table, context_lens, scale, k_scales=None, v_scales=None,
    window=0)``: out and q ``(B, H, D)`` (last dim contiguous), caches
    ``(P, page, KVH, D)`` contiguous, page_table ``(B, max_pages)`` and
    context_lens ``(B,)`` int32/int64, for quantized caches the bfloat16
    scales ``(P, page, KVH)``, and ``window`` a sliding window (keys each
    query sees, itself included; 0: all), whose earlier pages are not read;
    it writes ``out`` in place.
    """
    if not supports(device, dtype, head_dim, cache_dtype):
        return None
    module = load_extension()
    if module is None:
        return None
    op: PagedDecode = module.paged_decode
    return op


def get_quantize_write(
    device: torch.device | str, dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype
) -> QuantizeWrite | None:
    """The ``quantize_write`` op for a quantized pool, or None (as ``get_paged_decode``).

    Arguments ``(k, v, slots, k_cache, v_cache, k_scales, v_scales)``: k and v
    ``(T, KVH, D)`` in ``dtype`` (last dim contiguous), slots ``(T,)``, the
    caches' flat ``(slots, KVH, D)`` and scales' ``(slots, KVH)`` views.
    Writes exactly what ``kv_quant.quantize_kv`` computes.
    """
    if cache_dtype not in QUANTIZED_CACHE_DTYPES or not supports(device, dtype, head_dim, cache_dtype):
        return None
    module = load_extension()
    if module is None:
        return None
    op: QuantizeWrite = module.quantize_write
    return op



def get_quant_gemm() -> Any | None:
    """The module holding the weight-only products and dequantizers (``csrc/quant_gemm.cpp``), or None.

    None when the kernels are disabled or the extension cannot be built (as
    ``get_paged_decode``). ``int8_gemm(out, x, q, scales, group_size)`` and
    ``int4_gemm(out, x, codes, dm, group_size)`` write ``out`` (M, N) float32
    from ``x`` (M, K) float32, K a multiple of 32; ``int8_dequant(w, q, scales,
    group_size)`` and ``int4_dequant(w, codes, dm, group_size)`` write the
    float32 weight (N, K) itself. The layouts are in the source.
    """
    return load_extension()


def get_gemv() -> Gemv | None:
    """The float32 product of one or two rows, ``gemv_f32(out, x, weight, bias)`` (``csrc/gemv.cpp``), or None.

    None as ``get_paged_decode`` (kernels disabled or not buildable). It
    writes ``out`` (M, N) = ``x`` (M, K) @ ``weight`` (N, K)^T + ``bias`` (N,)
    or no bias; every tensor float32, contiguous, on the CPU; M is 1 or 2,
    any K. ``gemv_isa()`` names the vector path it was built with.
    """
    module = load_extension()
    if module is None:
        return None
    op: Gemv = module.gemv_f32
    return op


def gemv_isa() -> str | None:
    """The vector path the loaded ``gemv_f32`` runs: ``avx512``, ``avx2`` or ``scalar``; None without the kernel."""
    module = load_extension()
    if module is None:
        return None
    isa: str = module.gemv_isa()
    return isa
