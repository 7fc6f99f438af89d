from __future__ import annotations

import math

import pytest

from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n"),
        ({"seed": "x"}, "seed"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {1: -101}}, "logit_bias"),
        ({"logit_bias": {1: math.nan}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"1": 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: "x"}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
    ],
)
def test_invalid_values_name_their_parameter(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param
    assert param in str(info.value)


def test_defaults_and_normalisation() -> None:
    p = SamplingParams(stop="END", stop_token_ids=[3, 4], temperature=0)
    assert p.stop == ("END",)
    assert p.stop_token_ids == (3, 4)
    assert p.greedy and not p.needs_penalties
    assert SamplingParams(frequency_penalty=0.5).needs_penalties
    assert SamplingParams(repetition_penalty=1.2).needs_penalties


def test_errors_survive_pickling_with_param() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(InvalidParameterError("top_p", "must be in (0, 1]")))
    assert type(err) is InvalidParameterError
    assert err.param == "top_p" and str(err) == "top_p: must be in (0, 1]"


def test_sampler_view_keeps_what_the_sampler_reads_and_is_shared() -> None:
    a = SamplingParams(max_tokens=5, temperature=0.7, top_k=4, seed=3, stop=["x"], logprobs=2, n=2)
    b = SamplingParams(max_tokens=99, temperature=0.7, top_k=4, seed=3, ignore_eos=True, logprobs=2)
    view = a.sampler_view()
    assert view is b.sampler_view()  # equal sampler settings: one object, pickled once per batch
    assert (view.temperature, view.top_k, view.seed, view.logprobs) == (0.7, 4, 3, 2)
    assert (view.max_tokens, view.stop, view.n, view.ignore_eos) == (16, (), 1, False)
    assert SamplingParams(temperature=0.7, top_k=4, seed=4, logprobs=2).sampler_view() is not view
    assert SamplingParams(repetition_penalty=1.2).sampler_view().needs_penalties
    biased = SamplingParams(max_tokens=3, logit_bias={9: -1, 2: 100})
    assert biased.logit_bias == ((2, 100.0), (9, -1.0))  # a mapping is stored as sorted pairs
    assert biased.sampler_view().logit_bias == biased.logit_bias
    assert biased.sampler_view() is SamplingParams(logit_bias=((2, 100), (9, -1.0))).sampler_view()
