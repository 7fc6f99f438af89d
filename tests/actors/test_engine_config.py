"""EngineConfig: attention_backend names only backends that can run here, and says which one runs."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from actors.config import EngineConfig
from actors.runner.model_runner import make_attention_backend
from kvcache.attention.torch_paged import TorchPagedAttention
from kvcache.kv_pool import KVPool
from scheduling.errors import InvalidParameterError


def _flashinfer_runs_here() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


@pytest.mark.parametrize("device", ["cpu", "cuda", "auto"])
def test_flashinfer_is_refused_where_it_cannot_run_naming_the_parameter(device: str) -> None:
    # FlashInfer runs on CUDA with flashinfer installed (or with test-given
    # kernels); anywhere else asking for it must fail when the config is
    # built, not quietly run the torch path.
    if device != "cpu" and _flashinfer_runs_here():
        pytest.skip("FlashInfer can run here: tests/kvcache/attention/test_flashinfer_backend.py covers it")
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(attention_backend="flashinfer", device=device)
    assert err.value.param == "attention_backend"
    assert "flashinfer" in err.value.message and "torch" in err.value.message
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig.from_kwargs(attention_backend="flashinfer")
    assert err.value.param == "attention_backend"


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(attention_backend="xformers")
    assert err.value.param == "attention_backend" and "'xformers'" in err.value.message


@pytest.mark.parametrize("asked", ["auto", "torch"])
def test_auto_and_torch_resolve_to_the_torch_backend_that_runs(asked: str) -> None:
    config = EngineConfig(attention_backend=asked, device="cpu")
    assert config.resolved_attention_backend() == "torch"
    pool = KVPool(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=8,
                  dtype=torch.float32, device=torch.device("cpu"))
    backend = make_attention_backend(config, pool, num_heads=2, num_kv_heads=1, head_dim=8)
    assert isinstance(backend, TorchPagedAttention)


def test_kv_cache_dtype_names_are_vllms_and_fp8_is_e4m3() -> None:
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    assert EngineConfig().kv_cache_dtype == "auto"


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype"),
        ({"quantization": "awq"}, "quantization"),
        ({"quantization_group_size": 32}, "quantization_group_size"),
        ({"quantization": "int8", "quantization_group_size": 32}, "quantization_group_size"),
        ({"quantization": "int4", "quantization_group_size": 48}, "quantization_group_size"),
    ],
)
def test_quantization_options_are_refused_by_name(options: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(**options)  # type: ignore[arg-type]
    assert err.value.param == param


@pytest.mark.parametrize(("options", "param"), [({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
                                                 ({"quantization": "int4"}, "quantization")])
def test_quantization_on_cuda_is_refused_by_name(options: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(device="cuda", **options)  # type: ignore[arg-type]
    assert err.value.param == param and "CPU only" in err.value.message
