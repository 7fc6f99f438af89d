"""The native ``paged_decode`` kernel: raw op and through TorchPagedAttention.

Oracles: float64 dense attention over each sequence's true k/v, and the torch
path (``FLOTILLA_CPU_KERNELS=0``). The kernel tests skip, saying why, only
where no C++ compiler exists; with one, a failed build fails them
(``tests.kvcache.native``).
"""

from __future__ import annotations

import logging
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import cpu_kernels
from kvcache.attention.backend import StepLayout
from kvcache.attention.torch_paged import TorchPagedAttention
from kvcache.kv_pool import KVPool
from tests.kvcache.attention.test_torch_attention import Sim, dense_attention

HEADS = [(4, 4), (8, 4), (6, 2), (8, 1), (16, 2)]  # MHA, GQA, GQA 3, MQA, GQA 8


def random_problem(
    rng: random.Random, *, batch: int, heads: tuple[int, int], head_dim: int, page_size: int,
    max_ctx: int, dtype: torch.dtype = torch.float32, index_dtype: torch.dtype = torch.int32,
) -> dict[str, Any]:
    """Shuffled pages, padded tables whose padding is junk the kernel must not read."""
    (num_heads, num_kv), ctxs = heads, [rng.randint(1, max_ctx) for _ in range(batch)]
    used = [-(-c // page_size) for c in ctxs]
    free = list(range(num_pages := sum(used) + 3))
    rng.shuffle(free)
    width = max(used) + rng.randint(0, 2)
    table = torch.full((batch, width), -12345, dtype=index_dtype)
    for b, n in enumerate(used):
        table[b, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=index_dtype)
    shape = (num_pages, page_size, num_kv, head_dim)
    k, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    # q and out as strided views, the way a fused qkv projection hands q over.
    q = torch.randn(batch, num_heads + 1, head_dim).to(dtype)[:, 1:]
    out = torch.full((batch, num_heads + 2, head_dim), float("nan"), dtype=dtype)[:, :num_heads]
    return {"out": out, "q": q, "k": k, "v": v, "table": table, "ctxs": ctxs}


def random_pool(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> KVPool:
    """A one-layer pool filled with noise."""
    pool = KVPool(
        num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype,
    )
    pool.k_caches[0].normal_()
    pool.v_caches[0].normal_()
    return pool


def reference(prob: dict[str, Any], scale: float | None = None) -> torch.Tensor:
    """float64 dense attention of each sequence's query over its whole context."""
    k, v, table = prob["k"], prob["v"], prob["table"]
    page_size, num_kv, head_dim = k.shape[1:]
    flat_k, flat_v = k.reshape(-1, num_kv, head_dim), v.reshape(-1, num_kv, head_dim)
    rows = []
    for b, c in enumerate(prob["ctxs"]):
        pos = torch.arange(c)
        slots = table[b].long()[pos // page_size] * page_size + pos % page_size
        q = prob["q"][b : b + 1]
        if scale is not None:  # dense_attention uses 1/sqrt(d); fold the ratio into q
            q = q.double() * scale * head_dim**0.5
        rows.append(dense_attention(q, flat_k[slots], flat_v[slots], c - 1))
    return torch.cat(rows)


def run_op(ext: Any, prob: dict[str, Any], scale: float) -> torch.Tensor:
    ctxs = torch.tensor(prob["ctxs"], dtype=prob["table"].dtype)
    ext.paged_decode(prob["out"], prob["q"], prob["k"], prob["v"], prob["table"], ctxs, scale)
    return prob["out"]


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_raw_op_matches_float64_reference(ext: Any, data: st.DataObject) -> None:
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    torch.manual_seed(rng.randint(0, 2**16))
    head_dim = data.draw(st.sampled_from([8, 16, 32, 64, 80, 128]))
    prob = random_problem(
        rng, batch=data.draw(st.integers(1, 70)), heads=data.draw(st.sampled_from(HEADS)),
        head_dim=head_dim, page_size=data.draw(st.sampled_from([1, 4, 16])),
        max_ctx=data.draw(st.sampled_from([1, 7, 33, 200, 600])),
        index_dtype=data.draw(st.sampled_from([torch.int32, torch.int64])),
    )
    scale = data.draw(st.sampled_from([head_dim**-0.5, 0.3]))
    out = run_op(ext, prob, scale)
    torch.testing.assert_close(out.double(), reference(prob, scale), atol=2e-5, rtol=2e-5)


def test_raw_op_bfloat16(ext: Any) -> None:
    rng = random.Random(5)
    prob = random_problem(
        rng, batch=40, heads=(8, 2), head_dim=64, page_size=16, max_ctx=600, dtype=torch.bfloat16
    )
    out = run_op(ext, prob, 64**-0.5)
    assert out.dtype == torch.bfloat16
    # Inputs are exact bf16 values; the only loss is rounding the output to bf16.
    torch.testing.assert_close(out.double(), reference(prob), atol=1e-2, rtol=1e-2)


def test_raw_op_is_deterministic_across_thread_counts(ext: Any) -> None:
    """Each head's math is one thread's, in one order: threads change nothing."""
    prob = random_problem(
        random.Random(9), batch=3, heads=(8, 4), head_dim=32, page_size=4, max_ctx=500
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_op(ext, prob, 0.2).clone()
        torch.set_num_threads(max(2, threads))
        many = run_op(ext, prob, 0.2).clone()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ctx0": 0}, "context_lens"), ({"ctx0": 10_000}, "context_lens"),
        ({"page00": 10_000}, "page_table"), ({"page00": -1}, "page_table"),
        ({"head_dim": 20}, "multiple of 8"), ({"dtype": torch.float64}, "float32"),
    ],
)
def test_raw_op_rejects_bad_inputs(ext: Any, change: dict[str, Any], message: str) -> None:
    prob = random_problem(
        random.Random(1), batch=2, heads=(4, 2), head_dim=change.get("head_dim", 16),
        page_size=4, max_ctx=30, dtype=change.get("dtype", torch.float32),
    )
    if "ctx0" in change:
        prob["ctxs"][0] = change["ctx0"]
    if "page00" in change:
        prob["table"][0, 0] = change["page00"]
    with pytest.raises(RuntimeError, match=message):
        run_op(ext, prob, 0.25)


def count_kernel_calls(backend: TorchPagedAttention) -> list[int]:
    """Wrap the backend's kernel so calls are counted; returns the live counter."""
    calls, op = [0], backend._decode_kernel
    assert op is not None

    def counted(*args: Any) -> None:
        calls[0] += 1
        op(*args)

    backend._decode_kernel = counted
    return calls


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(8, 4), (8, 1), (4, 4)])
def test_backend_mixed_steps_match_dense(ext: Any, page_size: int, heads: tuple[int, int]) -> None:
    """End to end: chunked prefills, fresh prompts and decodes in the same steps."""
    sim = Sim(heads=heads, head_dim=32, page_size=page_size, num_layers=2, seed=page_size)
    assert sim.backend.uses_cpu_kernel
    calls = count_kernel_calls(sim.backend)
    for s in range(6):
        sim.prefill_directly(s, sim.rng.randint(1, 90))
    sim.step([(s, 1) for s in range(6)])  # decode-only
    sim.step([(0, 1), (6, 40), (1, 1), (2, 17), (3, 1)])  # mixed, decodes interleaved
    sim.step([(6, 1), (4, 1), (7, 25), (5, 1), (8, 25)])  # mixed with equal fresh prompts
    sim.step([(s, 1) for s in range(9)])
    assert calls[0] == 4 * sim.num_layers


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_backend_random_steps_kernel_vs_torch_path(ext: Any, data: st.DataObject) -> None:
    """Same pool contents, same inputs: the kernel and the torch path agree."""
    heads, page_size = data.draw(st.sampled_from(HEADS)), data.draw(st.sampled_from([1, 4, 16]))
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    qlens = [1 if rng.random() < 0.7 else rng.randint(1, 30) for _ in range(data.draw(st.integers(1, 70)))]
    ctxs = [q + rng.randint(0, 600 - q) for q in qlens]
    num_pages = sum(-(-c // page_size) for c in ctxs) + 2
    pool = random_pool(num_pages, page_size, heads[1], 32, torch.float32)
    free = list(range(pool.num_pages))
    rng.shuffle(free)
    layout = StepLayout(qlens, ctxs, [[free.pop() for _ in range(-(-c // page_size))] for c in ctxs])
    q, k, v = (torch.randn(sum(qlens), h, 32) for h in (heads[0], heads[1], heads[1]))
    outs = []
    for switch in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(cpu_kernels.ENV_SWITCH, switch)
            backend = TorchPagedAttention(pool, num_heads=heads[0], num_kv_heads=heads[1], head_dim=32)
        assert backend.uses_cpu_kernel == (switch == "1")
        backend.plan(layout)
        outs.append(backend.forward(0, q, k, v))  # both write the same k/v to the same slots
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_backend_bfloat16_decode(ext: Any) -> None:
    pool = random_pool(64, 16, 2, 64, torch.bfloat16)
    backend = TorchPagedAttention(pool, num_heads=8, num_kv_heads=2, head_dim=64)
    assert backend.uses_cpu_kernel
    layout = StepLayout([1, 1, 1], [300, 5, 97], [list(range(0, 19)), [40], list(range(50, 57))])
    backend.plan(layout)
    q, k, v = (torch.randn(3, h, 64, dtype=torch.bfloat16) for h in (8, 2, 2))
    out = backend.forward(0, q, k, v)
    for b, (c, pages) in enumerate(zip(layout.context_lens, layout.page_tables, strict=True)):
        hist_k = pool.k_caches[0][pages].flatten(0, 1)[:c]
        hist_v = pool.v_caches[0][pages].flatten(0, 1)[:c]
        ref = dense_attention(q[b : b + 1], hist_k, hist_v, c - 1)
        torch.testing.assert_close(out[b : b + 1].double(), ref, atol=1e-2, rtol=1e-2)


def test_env_switch_off_gives_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any) -> None:
        raise AssertionError("kernel called although disabled")

    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    monkeypatch.setattr(cpu_kernels, "_module", SimpleNamespace(paged_decode=fail))
    assert cpu_kernels.load_extension() is None
    assert cpu_kernels.get_paged_decode("cpu", torch.float32, 32) is None
    sim = Sim(heads=(8, 4), head_dim=32, page_size=4, num_layers=1, seed=2)
    assert not sim.backend.uses_cpu_kernel
    sim.prefill_directly(0, 50)
    sim.step([(0, 1), (1, 9)])
    sim.step([(0, 1), (1, 1)])  # checked against dense attention inside


def test_build_failure_warns_once_and_falls_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Sources that cannot compile (as with no compiler): one warning, torch path, no crash.

    Every source is the broken one: a good one would still compile beside it
    (ninja finishes the jobs it started), a minute per variant for nothing.
    """
    broken = tmp_path / "broken.cpp"
    broken.write_text('#error "no compiler today"\n')
    monkeypatch.setenv("FLOTILLA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(cpu_kernels.ENV_SWITCH, raising=False)
    for source in ("SOURCE", "QUANT_GEMM_SOURCE", "GEMV_SOURCE"):
        monkeypatch.setattr(cpu_kernels, source, broken)
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_failure", None)
    with caplog.at_level(logging.WARNING, logger="flotilla.kvcache"):
        assert cpu_kernels.load_extension() is None
        assert cpu_kernels.load_extension() is None  # remembered: no second build, no warning
        sim = Sim(heads=(4, 2), head_dim=32, page_size=4, num_layers=1, seed=4)
    warnings = [r for r in caplog.records if r.name == "flotilla.kvcache"]
    assert len(warnings) == 1 and "torch path" in warnings[0].getMessage()
    assert "native" in warnings[0].getMessage() and "generic" in warnings[0].getMessage()
    failure = cpu_kernels.build_failure()  # what a native test's failure shows
    assert failure is not None and failure in warnings[0].getMessage()
    assert not sim.backend.uses_cpu_kernel
    sim.prefill_directly(0, 20)
    sim.step([(0, 1)])


def test_build_dir_and_supported_pools(ext: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_kernels.get_paged_decode("cpu", torch.float32, 32) is not None
    assert cpu_kernels.get_paged_decode("cpu", torch.bfloat16, 128) is not None
    for device, dtype, head_dim in [("cpu", torch.float64, 32), ("cpu", torch.float32, 20),
                                    ("meta", torch.float32, 32)]:
        assert cpu_kernels.get_paged_decode(device, dtype, head_dim) is None
    root = cpu_kernels.cache_dir() / "torch_extensions"
    assert Path(ext.__file__).resolve().is_relative_to(root.resolve())
    monkeypatch.setenv("FLOTILLA_CACHE_DIR", "/somewhere/else")
    assert cpu_kernels.build_dir("native").parent == Path("/somewhere/else/torch_extensions")


@pytest.mark.slow
def test_two_processes_build_at_once_despite_stale_lock(
    ext: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh cache holding the lock file of a killed build: two processes build, both load.

    What is under test is the build's locking, not the kernels: the processes
    build a module of bindings alone (seconds, where the kernels take a minute
    a build), through the same ``load_extension``.
    """
    monkeypatch.setenv("FLOTILLA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(cpu_kernels.ENV_SWITCH, raising=False)
    cpu_kernels.build_dir("native").mkdir(parents=True)
    (cpu_kernels.build_dir("native") / "lock").touch()  # torch would wait on it forever
    sources = {"SOURCE": tmp_path / "bindings.cpp", "QUANT_GEMM_SOURCE": tmp_path / "one.cpp",
               "GEMV_SOURCE": tmp_path / "two.cpp"}  # three files, as the real build has
    sources["SOURCE"].write_text("#include <pybind11/pybind11.h>\nint flotilla_one();\n"
                                 "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n"
                                 '  m.def("answer", []() { return 41 + flotilla_one(); });\n}\n')
    sources["QUANT_GEMM_SOURCE"].write_text("int flotilla_one() { return 1; }\n")
    sources["GEMV_SOURCE"].write_text("int flotilla_two() { return 2; }\n")
    script = "from pathlib import Path; from kvcache import cpu_kernels as c; " + "".join(
        f"c.{name} = Path({str(path)!r}); " for name, path in sources.items()
    ) + "m = c.load_extension(); assert m is not None and m.answer() == 42"
    root = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen([sys.executable, "-c", script], cwd=root, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    results = [(p.communicate(timeout=500)[1], p.returncode) for p in procs]
    assert [rc for _, rc in results] == [0, 0], results
