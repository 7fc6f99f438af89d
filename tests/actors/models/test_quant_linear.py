"""int8 / int4 weight-only linears: round-trip bounds, kernels vs F.linear, sharding, errors.

Bounds: int8 ``|w - q * scale| <= scale / 2``; int4 round-to-nearest
``|w - deq| <= d / 2`` plus the float16 rounding of the group's ``d`` and
``m`` (``2**-11 * (|m| + 16 * d)``, and float16's subnormal step), plus
float32 slack. Kernel outputs against ``F.linear`` on the dequantized weight:
the native kernels (``kernel`` fixture: ``native``) multiply in float32, so
within float32 rounding (relative ``1e-5`` of the output's scale); torch's
(``torch``: kernels switched off) round the input to bfloat16, so within
bfloat16 rounding (relative ``2**-7``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.models.embedding import REFINE_TOP_K, ParallelLMHead
from actors.models.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from actors.models.quant_linear import (
    DEQUANT_MIN_ROWS,
    Int4Codes,
    Int4Linear,
    Int8Blocks,
    Int8Linear,
    QuantizedLinear,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
)
from kvcache import cpu_kernels
from scheduling.errors import InvalidParameterError

BF16 = torch.bfloat16
F16 = torch.float16
# Both native paths: the quantized-weight loop below DEQUANT_MIN_ROWS rows, dequantize + float32 GEMM from it.
ROWS = [1, 3, DEQUANT_MIN_ROWS - 1, DEQUANT_MIN_ROWS, 150]


@pytest.fixture(params=["native", "torch"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Layers built under it use the native kernels (they must build here) or torch's (kernels off)."""
    if request.param == "torch":
        monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    else:
        monkeypatch.delenv(cpu_kernels.ENV_SWITCH, raising=False)
        assert cpu_kernels.get_quant_gemm() is not None
    return str(request.param)


def _weights(seed: int, rows: int, cols: int, magnitude: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * magnitude
    w[0] = 0.0  # an all-zero row (and constant groups) must not divide by zero
    if rows > 1:
        w[-1, 3] = 40 * magnitude  # an outlier sets its row's (group's) scale
    return w


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(2, 40), cols=st.integers(4, 70),
       magnitude=st.sampled_from([1e-4, 0.02, 1.0, 300.0]))
def test_int8_round_trip_within_half_a_scale(seed: int, rows: int, cols: int, magnitude: float) -> None:
    w = _weights(seed, rows, cols, magnitude)
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == BF16 and scales.shape == (rows,)
    err = (w - dequantize_int8(q, scales)).abs()
    bound = scales.float().unsqueeze(1) / 2 + 1e-6 * w.abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    assert bool((q[0] == 0).all())


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 24), groups=st.integers(1, 4),
       group_size=st.sampled_from([32, 64, 128]), magnitude=st.sampled_from([1e-4, 0.02, 1.0, 300.0]),
       offset=st.sampled_from([0.0, 3.0]))
def test_int4_round_to_nearest_within_half_a_scale(
    seed: int, rows: int, groups: int, group_size: int, magnitude: float, offset: float
) -> None:
    w = _weights(seed, rows, groups * group_size, magnitude) + offset * magnitude  # groups not centred on 0
    codes = quantize_int4(w, group_size)
    assert codes.codes.dtype == torch.uint8 and int(codes.codes.max()) <= 15
    assert codes.scales.shape == (rows, groups) == codes.zeros.shape
    # d and m are what the native kernel uses: already float16 values.
    d, m = codes.scales, codes.zeros - 8 * codes.scales
    assert torch.equal(d, d.to(F16).float()) and torch.equal(m, m.to(F16).float())
    d, m = d.repeat_interleave(group_size, dim=1), m.repeat_interleave(group_size, dim=1)
    bound = d / 2 + 2**-11 * (m.abs() + 16 * d) + 16 * 2**-24 + 1e-6 * w.abs().max()
    err = (w - codes.dequantize()).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


def _close_to_reference(layer: QuantizedLinear, kernel: str, x: torch.Tensor, w: torch.Tensor) -> None:
    """``layer(x)`` against float64 ``x @ w^T``, within the rounding of the kernel's input (module docstring)."""
    assert layer.float32_products == (kernel == "native")
    got = layer(x)
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], w.shape[0])
    if kernel == "native":
        want, tol = F.linear(x.double(), w.double()), 1e-5
    else:
        want, tol = F.linear(x.to(BF16).double(), w.double()), 2**-7
    if x.dtype == BF16:
        tol = max(tol, 2**-7)  # the output itself is rounded to bfloat16
    assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item() + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_int8_linear_matches_f_linear_on_the_dequantized_weight(kernel: str, dtype: torch.dtype, rows: int) -> None:
    w, x = _weights(1, 96, 64, 0.1), torch.randn(rows, 64).to(dtype)
    layer = Int8Linear.from_float(w)
    _close_to_reference(layer, kernel, x, layer.dequantize())
    _close_to_reference(layer, kernel, x.view(rows, 1, 64), layer.dequantize())  # any leading shape
    ids = torch.tensor([0, 5, 95, 5])
    assert torch.equal(layer.embed(ids, torch.float32), layer.dequantize()[ids])


@pytest.mark.parametrize("rows", ROWS)
def test_int8_blocks_multiply_by_their_group_scales(kernel: str, rows: int) -> None:
    """An int8 weight with a scale per group of 32 (GGUF Q8_0), as read from a file: float32 either way
    (torch's path dequantizes per product), rows and embedding lookups exactly ``q * scale``."""
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (48, 96), generator=g, dtype=torch.int8)
    scales = torch.rand(48, 3, generator=g).to(F16).float()
    layer = Int8Linear.from_blocks(Int8Blocks(q, scales, 32))
    w = (q.float().view(48, 3, 32) * scales.unsqueeze(-1)).view(48, 96)
    assert torch.equal(layer.dequantize(), w) and layer.float32_products
    x = torch.randn(rows, 96)
    want = F.linear(x.double(), w.double())
    assert (layer(x).double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    ids = torch.tensor([0, 47, 3, 3])
    assert torch.equal(layer.embed(ids, torch.float32), w[ids])
    assert Int8Blocks(q, scales, 32).rows(5, 2).codes.shape == (2, 96)


def test_layers_whose_input_dim_the_native_kernels_cannot_take_use_torch_s() -> None:
    assert Int8Linear.from_float(_weights(1, 16, 48, 0.1)).float32_products is False  # 48: not a multiple of 32
    assert Int8Linear.from_float(_weights(1, 16, 64, 0.1)).float32_products is True


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", ROWS)
def test_int4_linear_matches_f_linear_on_the_dequantized_weight(kernel: str, group_size: int, rows: int) -> None:
    """Also pins the kernels' semantics: ``w = (q - 8) * scale + zero``."""
    w, x = _weights(2, 48, 256, 0.1) + 0.05, torch.randn(rows, 256)
    codes = quantize_int4(w, group_size)
    layer = Int4Linear(codes)
    if kernel == "torch":  # torch's kernel rounds scale and zero to bfloat16 at packing
        codes = Int4Codes(codes.codes, codes.scales.to(BF16).float(), codes.zeros.to(BF16).float(), group_size)
    _close_to_reference(layer, kernel, x, codes.dequantize())
    if kernel == "native":
        native = torch.empty(48, 256)  # what the layer multiplies by, written by the kernels' own dequantizer
        ext = cpu_kernels.get_quant_gemm()
        assert ext is not None
        ext.int4_dequant(native, layer.packed, layer.scales_and_zeros, group_size)
        torch.testing.assert_close(native, codes.dequantize(), rtol=0, atol=1e-7)


def _full_codes(rows: int, cols: int, group_size: int, seed: int) -> Int4Codes:
    return quantize_int4(_weights(seed, rows, cols, 0.1) + 0.01 * seed, group_size)


def _kernel_weight(layer: ParallelLinear) -> torch.Tensor:
    """The weight a quantized layer multiplies by, read back through one-hot inputs (bfloat16 exact)."""
    assert layer.quant is not None
    return layer.quant(torch.eye(layer.in_features)).t()


def _assert_holds(layer: ParallelLinear, want: torch.Tensor) -> None:
    got = _kernel_weight(layer)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 2**-8 * want.abs().max().item()


def test_int4_codes_shard_like_the_float_weight_in_every_layer_kind() -> None:
    """tp=2: each rank's layer, fed full Int4Codes, holds its slice of the full weight."""
    g, tp = 32, 2
    q, k, v = (_full_codes(n, 64, g, s) for s, n in enumerate((64, 32, 32)))
    gate, up = _full_codes(64, 64, g, 3), _full_codes(64, 64, g, 4)
    down = _full_codes(32, 128, g, 5)
    col = _full_codes(64, 64, g, 6)
    for rank in range(tp):
        qkv = QKVParallelLinear(64, 16, 4, 2, tp_rank=rank, tp_size=tp)
        for shard_id, part in zip("qkv", (q, k, v), strict=True):
            assert qkv.quant is None  # packs only once every part has arrived
            qkv.load_weight("weight", part, shard_id)
        half = [t.dequantize() for t in (q, k, v)]
        _assert_holds(qkv, torch.cat([half[0][rank * 32:(rank + 1) * 32], half[1][rank * 16:(rank + 1) * 16],
                                      half[2][rank * 16:(rank + 1) * 16]]))
        merged = MergedColumnParallelLinear(64, [64, 64], tp_rank=rank, tp_size=tp)
        merged.load_weight("weight", gate, 0)
        merged.load_weight("weight", up, 1)
        _assert_holds(merged, torch.cat([t.dequantize()[rank * 32:(rank + 1) * 32] for t in (gate, up)]))
        row = RowParallelLinear(128, 32, tp_rank=rank, tp_size=tp)
        row.load_weight("weight", down)
        _assert_holds(row, down.dequantize()[:, rank * 64:(rank + 1) * 64])
        column = ColumnParallelLinear(64, 64, tp_rank=rank, tp_size=tp)
        column.load_weight("weight", col)
        _assert_holds(column, col.dequantize()[rank * 32:(rank + 1) * 32])
        for layer in (qkv, merged, row, column):
            assert layer.weight.numel() == 0 and not layer.pack_for_cpu()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_frees_the_float_weight_and_keeps_the_bias(method: str) -> None:
    layer = ColumnParallelLinear(64, 32, bias=True)
    layer.weight.data.normal_(std=0.1)
    layer.bias.data.normal_()  # type: ignore[union-attr]
    x = torch.randn(5, 64)
    want = layer(x)
    layer.quantize(method, 32 if method == "int4" else None)
    assert layer.weight.numel() == 0 and layer.quant is not None
    assert not layer.pack_for_cpu()
    tolerance = {"int8": 0.02, "int4": 0.1}[method]  # of the output's scale
    assert (layer(x) - want).abs().max().item() < tolerance * want.abs().max().item()


def test_int4_shapes_the_kernel_cannot_take_are_refused_by_name() -> None:
    with pytest.raises(InvalidParameterError) as e:
        ColumnParallelLinear(96, 32).check_int4(64)
    assert e.value.param == "quantization_group_size" and "96" in e.value.message
    with pytest.raises(InvalidParameterError) as e:
        RowParallelLinear(128, 32, tp_rank=1, tp_size=4).check_int4(64)  # 32 input features a rank
    assert e.value.param == "quantization_group_size" and "tensor_parallel_size=4" in e.value.message
    with pytest.raises(InvalidParameterError) as e:
        ColumnParallelLinear(64, 40).check_int4(32)
    assert e.value.param == "quantization" and "16" in e.value.message


def test_an_int8_head_recomputes_its_top_logits_in_float32(kernel: str) -> None:
    """bfloat16 logits would tie two candidates 0.02 apart at ~25; the top ones come out in float32
    (all of them with the native kernel, the top ``REFINE_TOP_K`` recomputed after torch's)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 32, generator=g)
    hidden[0, 5] = 0.5
    q = torch.randint(-20, 20, (64, 32), generator=g, dtype=torch.int8)
    scales = torch.full((64,), 0.04)
    q[7] = torch.round(hidden[0] * 625 / hidden[0].square().sum()).clamp(-127, 126).to(torch.int8)
    q[9] = q[7]
    q[9, 5] += 1  # row 9 scores 0.04 * 0.5 = 0.02 more than row 7; one bfloat16 step is 0.125 there
    head = ParallelLMHead(64, 32)
    head.set_quant(Int8Linear(q, scales))
    assert head.quant is not None
    exact = hidden @ head.quant.dequantize().t()
    assert 20 < exact[0, 9].item() < 32 and exact[0, 9] > exact[0, 7]
    if kernel == "torch":
        assert head.quant(hidden)[0, 9] == head.quant(hidden)[0, 7]  # the kernel's bfloat16 logits tie
    else:
        torch.testing.assert_close(head.quant(hidden), exact, rtol=1e-6, atol=1e-5)
    logits = head(hidden)
    assert logits.dtype == torch.float32 and int(logits[0].argmax()) == int(exact[0].argmax()) == 9
    top = exact.topk(REFINE_TOP_K, dim=-1).indices
    torch.testing.assert_close(logits.gather(-1, top), exact.gather(-1, top), rtol=1e-6, atol=1e-5)
    assert (logits - exact).abs().max().item() <= 2**-8 * exact.abs().max().item()
    assert head(hidden.to(BF16)).dtype == BF16  # a bfloat16 model keeps bfloat16 logits
