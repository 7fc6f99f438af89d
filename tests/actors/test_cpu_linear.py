"""oneDNN-packed linear layers on CPU: same products as F.linear, a clean fallback, memory released."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.models import cpu_linear
from actors.models.layers import ColumnParallelLinear, RowParallelLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 37])
def test_packed_product_matches_f_linear(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    packed = cpu_linear.pack(w, b)
    if packed is None:
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
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
