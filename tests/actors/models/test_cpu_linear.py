"""CPU linear layers: oneDNN-packed products, and the kernel chosen for one or two float32 rows, against F.linear / float64."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from actors.models import cpu_linear
from actors.models.embedding import ParallelLMHead
from actors.models.layers import ColumnParallelLinear, RowParallelLinear
from kvcache import cpu_kernels
from scheduling.errors import InvalidParameterError
from tests.kvcache.native import fail_if_compiler, require_native

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 37])
def test_packed_product_matches_f_linear(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    packed = cpu_linear.pack(w, b)
    if packed is None and dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 path on this CPU")
    # Anywhere else a failed pack (the probe disagreeing, oneDNN raising) is a broken fast path.
    assert packed is not None, f"oneDNN could not pack {dtype} (see the flotilla warning)"
    want, got = F.linear(x, w, b).float(), cpu_linear.linear(x, packed, b).float()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_switch_off_and_unpackable_weights_keep_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(8, 8)
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "0")
    assert cpu_linear.pack(w, None) is None
    monkeypatch.delenv(cpu_linear.ENV_SWITCH)
    assert cpu_linear.pack(w.to(torch.float16), None) is None  # not a packable dtype
    assert cpu_linear.pack(w, None) is not None


@pytest.mark.parametrize("layer_cls", [ColumnParallelLinear, RowParallelLinear])
def test_a_packed_layer_gives_the_same_output_for_few_and_many_rows(layer_cls: type) -> None:
    torch.manual_seed(0)
    layer = layer_cls(64, 48, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    xs = [torch.randn(n, 64) for n in (1, cpu_linear.DENSE_MAX_ROWS, cpu_linear.DENSE_MAX_ROWS + 1, 5)]
    before = [layer(x) for x in xs]
    assert layer.pack_for_cpu()
    assert layer.packed is not None and layer.weight.shape == (48, 64)  # dense kept for few rows
    for x, want in zip(xs, before, strict=True):
        assert torch.allclose(layer(x), want, rtol=1e-5, atol=1e-4)


def test_few_rows_read_the_dense_weight_and_more_the_packed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = ColumnParallelLinear(64, 48)
    layer.weight.data.normal_()
    assert layer.pack_for_cpu()
    calls: list[int] = []
    real = cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda x, p, b: calls.append(x.shape[0]) or real(x, p, b))
    for n in (1, cpu_linear.DENSE_MAX_ROWS, cpu_linear.DENSE_MAX_ROWS + 1, 9):
        layer(torch.randn(n, 64))
    assert calls == [cpu_linear.DENSE_MAX_ROWS + 1, 9]


def native_or_skip() -> cpu_linear.GemvChoice:
    """The native kernel forced; skips only where no compiler exists to build it (``require_native``)."""
    require_native(cpu_kernels.get_gemv)
    return cpu_linear.choose_gemv("native")


def counting(choice: cpu_linear.GemvChoice, calls: list[int]) -> cpu_linear.GemvChoice:
    """``choice`` with its native op counting the rows of each call (none for ``torch``)."""
    op = choice.op
    if op is None:
        return choice

    def count(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
        calls.append(x.shape[0])
        op(out, x, w, b)

    return dataclasses.replace(choice, op=count)


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_f,in_f", [(1, 1), (7, 13), (96, 64), (333, 1000), (576, 1536)])
def test_each_forced_kernel_matches_float64(monkeypatch: pytest.MonkeyPatch, kernel: str, rows: int,
                                            bias: bool, out_f: int, in_f: int) -> None:
    choice = native_or_skip() if kernel == "native" else cpu_linear.choose_gemv("torch")
    calls: list[int] = []
    monkeypatch.setattr(cpu_linear, "_choice", counting(choice, calls))
    gen = torch.Generator().manual_seed(out_f + in_f + rows)
    w, x = torch.randn(out_f, in_f, generator=gen), torch.randn(rows, in_f, generator=gen)
    b = torch.randn(out_f, generator=gen) if bias else None
    got = cpu_linear.dense(x, w, b).double()
    want = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    scale = float((x.double().abs() @ w.double().abs().T).max())
    assert float((got - want).abs().max()) <= 1e-5 * scale
    assert calls == ([rows] if kernel == "native" else [])


def test_native_kernel_serves_only_few_float32_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(cpu_linear, "_choice", counting(native_or_skip(), calls))
    w = torch.randn(24, 16)
    for x in (torch.randn(1, 16), torch.randn(3, 16), torch.randn(2, 16).to(torch.bfloat16),
              torch.randn(16, 2).T):  # the last: two rows, not contiguous
        w_ = w.to(x.dtype)
        assert torch.allclose(cpu_linear.dense(x, w_, None).float(), F.linear(x, w_).float(), rtol=1e-2, atol=1e-2)
    assert calls == [1, 2]


def test_layer_and_lm_head_use_the_chosen_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(cpu_linear, "_choice", counting(native_or_skip(), calls))
    torch.manual_seed(0)
    layer, head = RowParallelLinear(64, 48, bias=True), ParallelLMHead(100, 64)
    for p in (layer.weight, layer.bias, head.weight):
        p.data.normal_()
    x = torch.randn(2, 64)
    assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
    assert torch.allclose(head(x), F.linear(x, head.weight)[:, :100], rtol=1e-5, atol=1e-4)
    assert calls == [2, 2]


def test_auto_times_both_kernels_and_keeps_the_faster() -> None:
    choice = cpu_linear.choose_gemv("auto")
    if cpu_kernels.get_gemv() is None:
        fail_if_compiler("the native gemv")
        assert (choice.kernel, choice.op) == ("torch", None) and choice.reason.startswith("no native kernel")
        return
    assert choice.reason == "measured" and choice.isa == cpu_kernels.gemv_isa()
    assert choice.native_ms is not None and choice.torch_ms is not None
    assert choice.native_ms > 0 and choice.torch_ms > 0
    assert choice.kernel == ("native" if choice.native_ms <= choice.torch_ms else "torch")
    assert (choice.op is not None) == (choice.kernel == "native")
    assert choice.report()["kernel"] == choice.kernel


@pytest.mark.parametrize("value,kernel", [("torch", "torch"), (" Native ", "native")])
def test_the_env_switch_forces_a_kernel(monkeypatch: pytest.MonkeyPatch, value: str, kernel: str) -> None:
    if kernel == "native":
        native_or_skip()
    monkeypatch.setenv(cpu_linear.GEMV_SWITCH, value)
    monkeypatch.setattr(cpu_linear, "_choice", None)  # this process's choice is made again, from the switch
    choice = cpu_linear.few_rows_choice()
    assert (choice.kernel, choice.reason) == (kernel, f"forced by {cpu_linear.GEMV_SWITCH}")
    assert cpu_linear.current_few_rows_choice() is choice
    assert cpu_linear.few_rows_choice() is choice  # made once


def test_forcing_native_without_the_kernel_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    with pytest.raises(InvalidParameterError, match=f"{cpu_kernels.ENV_SWITCH}=0") as err:
        cpu_linear.choose_gemv("native")
    assert err.value.param == cpu_linear.GEMV_SWITCH
    auto = cpu_linear.choose_gemv("auto")  # not forced: F.linear, and the choice says why
    assert (auto.kernel, auto.reason) == ("torch", f"no native kernel: {cpu_kernels.ENV_SWITCH}=0")


def test_an_unknown_switch_value_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_linear.GEMV_SWITCH, "mkl-please")
    with pytest.raises(InvalidParameterError, match="auto, native, torch") as err:
        cpu_linear.gemv_mode()
    assert err.value.param == cpu_linear.GEMV_SWITCH
    monkeypatch.setenv(cpu_linear.GEMV_SWITCH, "")
    assert cpu_linear.gemv_mode() == "auto"
