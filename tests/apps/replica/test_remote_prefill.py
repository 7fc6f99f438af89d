"""The decode replica's per-request choice and its retry, with fake handles; the ``pd`` app arguments."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actors.api import PrefillResult
from apps.builder import build_app
from apps.protocol.errors import APIError
from apps.replica.disaggregation import (
    DEFAULT_REMOTE_PREFILL_TIMEOUT_S,
    PREFILL_ATTEMPTS,
    RemotePrefill,
)
from scheduling.errors import InvalidParameterError
from scheduling.pooling import DEFAULT_POOLING
from scheduling.sampling_params import SamplingParams
from scheduling.structured_output import StructuredOutput

NEVER = object()  # an outcome: the call is never answered (a hung replica)


class Call:
    """What ``handle.method.remote(...)`` returns: an awaitable of ``outcome`` (raised if an exception);
    ``cancel()`` records that the caller cancelled it, as ``DeploymentResponse.cancel`` would."""

    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome
        self.cancelled = False

    def __await__(self) -> Any:
        async def run() -> Any:
            if self.outcome is NEVER:
                await asyncio.Event().wait()
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome
        return run().__await__()

    def cancel(self) -> None:
        self.cancelled = True


class Method:
    """A method of a fake Serve handle (``remote``) or scheduler (called)."""

    def __init__(self, outcomes: list[Any]) -> None:
        self.outcomes, self.calls = outcomes, []
        self.responses: list[Call] = []

    def remote(self, *args: Any, **kwargs: Any) -> Call:
        self.calls.append(args)
        self.responses.append(Call(self.outcomes.pop(0)))
        return self.responses[-1]

    __call__ = remote  # a SchedulerHandle's method makes the call as a Serve handle's ``remote`` does


class Fake:
    def __init__(self, **methods: list[Any]) -> None:
        for name, outcomes in methods.items():
            setattr(self, name, Method(outcomes))


def result(rid: str) -> PrefillResult:
    return PrefillResult(rid, 7, None, (), 40, 0, 1234, 0.01, (None, None))


def test_long_uncached_prompts_go_remote_and_others_stay() -> None:
    actor = Fake(cached_prefix_tokens=[0, 32, 0])
    remote = RemotePrefill(Fake(), actor, min_tokens=16)
    params = SamplingParams(max_tokens=4)
    assert asyncio.run(remote.wants(list(range(40)), params))  # 40 uncached
    assert not asyncio.run(remote.wants(list(range(40)), params))  # 32 of 40 cached: 8 left
    assert not asyncio.run(remote.wants(list(range(8)), params))  # short: no call at all
    assert not asyncio.run(remote.wants(list(range(40)), SamplingParams(n=2)))
    constrained = SamplingParams(structured_output=StructuredOutput.json_object())
    assert not asyncio.run(remote.wants(list(range(40)), constrained))
    assert not asyncio.run(remote.wants(list(range(40)), SamplingParams(pooling=DEFAULT_POOLING)))  # an embedding
    assert len(actor.cached_prefix_tokens.calls) == 2


def test_a_failed_prefill_is_retried_once_then_a_503() -> None:
    handle = Fake(prefill=[RuntimeError("replica died"), result("r.p1")])
    actor = Fake(submit_prefilled=[40])
    remote = RemotePrefill(handle, actor, min_tokens=16)
    assert asyncio.run(remote.submit("r", list(range(40)), SamplingParams(), "c")) == 40
    (sent, *_), = actor.submit_prefilled.calls
    assert sent.request_id == "r" and remote.num_retries == 1 and remote.transfer_bytes == 1234
    assert [c[0] for c in handle.prefill.calls] == ["r.p0", "r.p1"]  # a fresh id per attempt

    # Fetching the KV can fail too (its replica died after the prefill): the attempt is retried whole.
    lost = Fake(submit_prefilled=[RuntimeError("object lost"), 40])
    again = RemotePrefill(Fake(prefill=[result("a"), result("b")]), lost, min_tokens=16)
    assert asyncio.run(again.submit("q", list(range(40)), SamplingParams(), "c")) == 40 and again.num_retries == 1

    dead = RemotePrefill(Fake(prefill=[RuntimeError("down")] * PREFILL_ATTEMPTS), Fake(), min_tokens=16)
    with pytest.raises(APIError) as info:
        asyncio.run(dead.submit("r", list(range(40)), SamplingParams(), "c"))
    assert info.value.status == 503 and "prefill pool" in str(info.value)


def test_a_hung_prefill_replica_times_out_is_cancelled_and_retried_then_a_503() -> None:
    """A prefill side that never answers: each attempt ends after ``timeout_s`` and cancels its call (which
    aborts the request on that replica); the retry goes on as after a dead replica."""
    handle = Fake(prefill=[NEVER, result("r.p1")])
    actor = Fake(submit_prefilled=[40])
    remote = RemotePrefill(handle, actor, min_tokens=16, timeout_s=0.05)
    assert asyncio.run(remote.submit("r", list(range(40)), SamplingParams(), "c")) == 40
    assert [r.cancelled for r in handle.prefill.responses] == [True, False] and remote.num_retries == 1
    assert [c[0] for c in handle.prefill.calls] == ["r.p0", "r.p1"]

    hung = Fake(prefill=[NEVER] * PREFILL_ATTEMPTS)
    never = RemotePrefill(hung, Fake(), min_tokens=16, timeout_s=0.05)
    with pytest.raises(APIError) as info:
        asyncio.run(never.submit("r", list(range(40)), SamplingParams(), "c"))
    assert info.value.status == 503 and "prefill pool" in str(info.value) and "within 0.05 s" in str(info.value)
    assert all(r.cancelled for r in hung.prefill.responses) and len(hung.prefill.responses) == PREFILL_ATTEMPTS


def test_the_prefill_timeout_has_a_documented_default_and_is_checked() -> None:
    assert RemotePrefill(Fake(), Fake()).timeout_s == DEFAULT_REMOTE_PREFILL_TIMEOUT_S > 0
    for bad in (0, -1.0, "10", True):
        with pytest.raises(InvalidParameterError) as info:
            RemotePrefill(Fake(), Fake(), timeout_s=bad)  # type: ignore[arg-type]
        assert info.value.param == "remote_prefill_timeout_s"


def test_a_bad_request_is_not_retried() -> None:
    handle = Fake(prefill=[InvalidParameterError("logit_bias", "bad"), result("x")])
    with pytest.raises(InvalidParameterError):
        asyncio.run(RemotePrefill(handle, Fake(), min_tokens=16).submit("r", list(range(40)), SamplingParams(), "c"))
    assert len(handle.prefill.calls) == 1


@pytest.mark.parametrize(("pd", "param"), [
    ("yes", "pd"),
    ({"prefill": {}, "decode": {}, "colour": 1}, "pd"),
    ({"prefill": {"kv_cache_dtype": "int8"}, "decode": {}}, "pd.prefill"),
    ({"prefill": {"api_keys": "k"}, "decode": {}}, "pd.prefill"),
    ({"prefill": {}, "decode": {}, "remote_prefill_timeout_s": 0}, "remote_prefill_timeout_s"),
    ({"prefill": {}, "decode": {}, "remote_prefill_min_tokens": 0}, "remote_prefill_min_tokens"),
])
def test_pd_arguments_are_checked_at_deploy_time(pd: Any, param: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        build_app({"model": "tiny", "kv_cache_dtype": "auto", "pd": pd})
    assert info.value.param == param


@pytest.mark.parametrize(("prefill", "decode", "key", "values"), [
    ({"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "fp8"}, "kv_cache_dtype", ("'int8'", "'fp8_e4m3'")),
    ({"page_size": 32}, {"page_size": 16 * 4}, "page_size", ("32", "64")),
    ({"page_size": 32}, {}, "page_size", ("32", "16")),  # the decode pool runs the default
    ({}, {"kv_cache_dtype": "int8"}, "kv_cache_dtype", ("'auto'", "'int8'")),
    # The weights compute the KV: an int8 prefill pool's pages fit a bfloat16 decode pool but are not its KV.
    ({"quantization": "int8"}, {}, "quantization", ("'int8'", "None")),
    ({"quantization": "int4", "quantization_group_size": 32}, {"quantization": "int4"},
     "quantization_group_size", ("32", "None")),
])
def test_pools_that_would_store_kv_differently_are_refused_naming_both_values(
        prefill: dict[str, Any], decode: dict[str, Any], key: str, values: tuple[str, str]) -> None:
    """Neither pool contradicts the app (it sets none of these), yet the pools disagree with each other."""
    with pytest.raises(InvalidParameterError) as info:
        build_app({"model": "tiny", "pd": {"prefill": prefill, "decode": decode}})
    message = str(info.value)
    assert key in message and f"prefill {values[0]}" in message and f"decode {values[1]}" in message, message


def test_pools_that_agree_build_and_pass_their_remote_options() -> None:
    app = build_app({"model": "tiny", "pd": {"prefill": {"page_size": 32}, "decode": {"page_size": 32},
                                             "remote_prefill_timeout_s": 5}})
    kwargs = app._bound_deployment.init_kwargs  # the decode replicas' LLMServer keywords
    assert kwargs["remote_prefill_timeout_s"] == 5 and kwargs["remote_prefill_min_tokens"] == 512
    assert kwargs["prefill"]._bound_deployment.init_args[0]["page_size"] == 32


def test_pd_takes_autoscaling_per_pool_only() -> None:
    with pytest.raises(InvalidParameterError) as info:
        build_app({"model": "tiny", "autoscaling": {"max_replicas": 2}, "pd": {"prefill": {}, "decode": {}}})
    assert info.value.param == "autoscaling"
    build_app({"model": "tiny", "pd": {"prefill": {"autoscaling": {"max_replicas": 2}},
                                       "decode": {"autoscaling": {"max_replicas": 2}}}})
