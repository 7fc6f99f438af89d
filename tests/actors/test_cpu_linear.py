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
def test_a_packed_layer_gives_the_same_output_and_drops_its_dense_weight(layer_cls: type) -> None:
    torch.manual_seed(0)
    layer = layer_cls(64, 48, bias=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(5, 64)
    before = layer(x)
    assert layer.pack_for_cpu()
    assert layer.weight.numel() == 0 and layer.packed is not None  # the packed copy replaced it
    assert torch.allclose(layer(x), before, rtol=1e-5, atol=1e-4)
