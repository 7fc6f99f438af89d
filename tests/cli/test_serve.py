"""``flotilla serve``'s command line becomes ``build_app`` arguments (no cluster started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.builder import build_app
from apps.replica.disaggregation import POOLS, REMOTE_OPTIONS
from cli.main import build_parser
from cli.serve import PD_KEYS, app_args
from scheduling.errors import InvalidParameterError


def _args(*argv: str) -> dict[str, object]:
    return app_args(build_parser().parse_args(["serve", *argv]))


def test_cpu_threads_reach_the_engine_config() -> None:
    args = _args("--model", "tiny", "--cpu-threads", "2")
    assert args["cpu_threads"] == 2
    build_app(args)  # validated like every engine option


def test_unset_cpu_threads_keep_the_default() -> None:
    assert "cpu_threads" not in _args("--model", "tiny")


def test_attention_backend_and_cuda_graphs_reach_the_engine_config() -> None:
    assert _args("--model", "tiny", "--attention-backend", "torch", "--no-cuda-graphs") == {
        "model": "tiny", "num_replicas": 1, "attention_backend": "torch", "cuda_graphs": False}
    build_app(_args("--model", "tiny", "--attention-backend", "torch", "--no-cuda-graphs"))
    assert "cuda_graphs" not in _args("--model", "tiny")  # unset: the engine decides where graphs run
    with pytest.raises(InvalidParameterError) as err:  # on this CPU machine: refused by name, before Ray starts
        build_app({**_args("--model", "tiny", "--cuda-graphs"), "device": "cpu"})
    assert err.value.param == "cuda_graphs"


def test_bad_cpu_threads_are_refused_before_ray_starts() -> None:
    with pytest.raises(InvalidParameterError) as err:
        build_app(_args("--model", "tiny", "--cpu-threads", "0"))
    assert err.value.param == "cpu_threads"


def test_scheduler_placement_reaches_the_app_only_when_not_the_default() -> None:
    assert "scheduler_placement" not in _args("--model", "tiny")
    args = _args("--model", "tiny", "--scheduler-placement", "replica")
    assert args["scheduler_placement"] == "replica"
    build_app(args)


def test_scheduler_actor_options_with_replica_placement_are_refused_before_ray_starts() -> None:
    with pytest.raises(InvalidParameterError) as err:
        build_app(_args("--model", "tiny", "--scheduler-placement", "replica", "--num-gpus", "1"))
    assert err.value.param == "scheduler_options"


def test_an_unknown_placement_is_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        _args("--model", "tiny", "--scheduler-placement", "shard")


def test_speculative_config_reaches_the_engine_and_bad_json_is_refused_before_ray_starts() -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    args = _args("--model", "tiny", "--speculative-config", spec)
    assert args["speculative_config"] == spec
    build_app(args)
    assert "speculative_config" not in _args("--model", "tiny")
    with pytest.raises(InvalidParameterError) as err:
        build_app(_args("--model", "tiny", "--speculative-config", '{"method": "ngram"}'))
    assert err.value.param == "speculative_config"


def test_quantization_flags_reach_the_engine_and_bad_combinations_are_refused_by_name() -> None:
    args = _args("--model", "tiny", "--kv-cache-dtype", "fp8", "--quantization", "int4",
                 "--quantization-group-size", "32")
    assert (args["kv_cache_dtype"], args["quantization"], args["quantization_group_size"]) == ("fp8", "int4", 32)
    build_app(args)
    plain = _args("--model", "tiny")
    assert not {"kv_cache_dtype", "quantization", "quantization_group_size"} & set(plain)
    with pytest.raises(InvalidParameterError) as err:
        build_app(_args("--model", "tiny", "--quantization", "int8", "--quantization-group-size", "32"))
    assert err.value.param == "quantization_group_size"
    with pytest.raises(SystemExit):
        _args("--model", "tiny", "--kv-cache-dtype", "int4")


def test_pd_reaches_the_app_as_two_pools() -> None:
    args = _args("--model", "tiny", "--pd", '{"prefill": {"cpu_threads": 1}, "decode": {"cpu_threads": 1}, '
                                             '"remote_prefill_min_tokens": 256}')
    assert args["pd"] == {"prefill": {"cpu_threads": 1}, "decode": {"cpu_threads": 1}, "remote_prefill_min_tokens": 256}
    build_app(args)
    with pytest.raises(InvalidParameterError) as err:
        _args("--model", "tiny", "--pd", '{"prefil": {}}')
    assert err.value.param == "pd"


def test_every_pd_option_of_the_app_reaches_it_from_the_command_line() -> None:
    """``--pd`` takes what ``pd`` takes in serve.yaml: both pools and each decode-replica option, by value."""
    assert set(PD_KEYS) == {*POOLS, *REMOTE_OPTIONS}
    args = _args("--model", "tiny", "--pd", '{"prefill": {}, "decode": {}, "remote_prefill_timeout_s": 5, '
                                             '"remote_prefill_min_tokens": 64}')
    kwargs = build_app(args)._bound_deployment.init_kwargs  # the decode replicas' LLMServer keywords
    assert (kwargs["remote_prefill_timeout_s"], kwargs["remote_prefill_min_tokens"]) == (5, 64)
    with pytest.raises(InvalidParameterError) as err:  # checked before Ray starts, by name
        build_app(_args("--model", "tiny", "--pd", '{"prefill": {}, "decode": {}, "remote_prefill_timeout_s": 0}'))
    assert err.value.param == "remote_prefill_timeout_s"


def test_lora_flags_reach_the_app(tmp_path: Path) -> None:
    args = _args("--model", "tiny", "--lora-modules", f"a={tmp_path}/a", "b=/x/b", "--max-loras", "2",
                 "--max-lora-rank", "32")  # fmt: skip
    assert args["lora_modules"] == {"a": f"{tmp_path}/a", "b": "/x/b"}
    assert args["max_loras"] == 2 and args["max_lora_rank"] == 32 and "enable_lora" not in args
    for bad in (["x"], ["=p"], ["a=p", "a=q"]):
        with pytest.raises(InvalidParameterError) as err:
            _args("--model", "tiny", "--lora-modules", *bad)
        assert err.value.param == "lora_modules"
    with pytest.raises(InvalidParameterError) as err:  # refused before Ray starts
        build_app({**_args("--model", "tiny", "--lora-modules", "a=/p"), "enable_lora": False})
    assert err.value.param == "lora_modules"
    with pytest.raises(InvalidParameterError) as err:
        build_app({**_args("--model", "tiny", "--enable-lora"),
                   "pd": {"prefill": {"num_replicas": 1}, "decode": {"num_replicas": 1}}})
    assert err.value.param == "pd"


def test_kv_offload_reaches_the_engine_and_bad_json_is_refused_before_ray_starts() -> None:
    offload = '{"host_bytes": 1000000, "cluster": true}'
    args = _args("--model", "tiny", "--kv-offload", offload)
    assert args["kv_offload"] == offload
    build_app(args)
    assert "kv_offload" not in _args("--model", "tiny")
    for bad in ('{"host_bytes": -1}', "{nope", '{"disk_path": "/tmp/x"}'):
        with pytest.raises(InvalidParameterError) as err:
            build_app(_args("--model", "tiny", "--kv-offload", bad))
        assert err.value.param == "kv_offload"


def test_expert_parallel_reaches_the_engine_config_only_when_asked() -> None:
    args = _args("--model", "tiny", "--tensor-parallel-size", "2", "--expert-parallel")
    assert args["expert_parallel"] is True and args["executor"] == "ray"
    build_app(args)  # a valid EngineConfig; a dense model refuses it when its shards load (test_model_families)
    assert "expert_parallel" not in _args("--model", "tiny")


def test_embedding_pooling_reaches_the_engine_config_only_when_asked() -> None:
    args = _args("--model", "tiny", "--embedding-pooling", "mean", "--no-embedding-normalize")
    assert (args["embedding_pooling"], args["embedding_normalize"]) == ("mean", False)
    build_app(args)
    plain = _args("--model", "tiny")
    assert "embedding_pooling" not in plain and "embedding_normalize" not in plain
    with pytest.raises(SystemExit):  # argparse refuses a mode it does not list
        _args("--model", "tiny", "--embedding-pooling", "max")
    with pytest.raises(InvalidParameterError) as err:  # and the engine config one given another way
        build_app({**plain, "embedding_pooling": "max"})
    assert err.value.param == "embedding_pooling"


def test_runtime_lora_updates_are_asked_for_and_relative_folders_are_the_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = _args("--model", "tiny", "--lora-modules", "a=./a/", "--runtime-lora-updates")
    assert args["lora_modules"] == {"a": f"{tmp_path}/a"} and args["runtime_lora_updates"] is True
    kwargs = build_app(args)._bound_deployment.init_kwargs
    assert kwargs["runtime_lora_updates"] is True
    assert "runtime_lora_updates" not in _args("--model", "tiny")  # off unless asked for
    with pytest.raises(InvalidParameterError) as err:
        build_app({**_args("--model", "tiny", "--runtime-lora-updates"), "enable_lora": False})
    assert err.value.param == "runtime_lora_updates"
    for not_a_bool in ("false", 1, None):  # serve.yaml's "false" is a string, and would have opened the routes
        with pytest.raises(InvalidParameterError) as err:
            build_app({**_args("--model", "tiny"), "runtime_lora_updates": not_a_bool})
        assert err.value.param == "runtime_lora_updates" and repr(not_a_bool) in err.value.message
