"""The offline API: run the engine in this process.

    from apps.llm import LLM
    from scheduling.sampling_params import SamplingParams

    llm = LLM(model="tiny")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
    print(outs[0].outputs[0].text)
    vectors = llm.embed(["Hello", "Bonjour"])  # one pooled vector per prompt (``LLM.embed``)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from actors.api import CompletionOutput, LoRAInfo, RequestOutput, chat_ids
from actors.config import EngineConfig
from actors.engine.executor import Executor
from actors.engine.llm_engine import LLMEngine
from actors.errors import ExecutorFailure
from scheduling.errors import InvalidParameterError
from scheduling.pooling import Pooling
from scheduling.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """An engine in this process. Keyword arguments are ``EngineConfig`` fields.

    With ``executor="ray"`` the model runs as ``tensor_parallel_size`` shard
    actors on the Ray cluster (``ray.init()`` is called if Ray is not
    initialised); the scheduler and detokenization stay in this process.
    """

    def __init__(self, model: str = "tiny", **engine_config: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_config)
        executor: Executor | None = None
        if self.config.executor == "ray":
            from actors.remote.ray_executor import (
                RayExecutor,  # Ray is imported only when asked for
            )

            executor = RayExecutor(self.config)
        try:
            self.engine = LLMEngine(self.config, executor)
        except BaseException:
            if executor is not None:
                executor.shutdown()  # the shards would otherwise outlive this failed LLM
            raise
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Release the model (for ``executor="ray"``: kill the shard actors)."""
        self.engine.shutdown()

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def load_lora(self, name: str, path: str) -> LoRAInfo:
        """Load the PEFT adapter in folder ``path`` as ``name`` (the engine needs ``enable_lora=True``)."""
        return self.engine.loras.add(name, str(path))

    def unload_lora(self, name: str) -> None:
        """Unload adapter ``name`` (offline nothing is in flight between calls: it goes at once)."""
        self.engine.loras.remove(name)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        namespace: str | None = None,
        lora: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in input order.

        ``lora``: a loaded adapter (``load_lora``) serving every prompt, in
        place of each params' own ``lora``; per-prompt adapters go in the
        ``SamplingParams`` list.
        """
        prompt_list = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidParameterError(
                    "sampling_params",
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts",
                )
        if lora is not None:
            params_list = [replace(p, lora=lora) for p in params_list]
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                rid = f"offline-{next(self._ids)}"
                ids = self.engine.tokenize(prompt)
                self.engine.add_request(rid, prompt, params, namespace=namespace, prompt_token_ids=ids)
                order.append(rid)
                results[rid] = RequestOutput(
                    rid, prompt if isinstance(prompt, str) else None, ids,
                    [CompletionOutput(i) for i in range(params.n)],
                )
            self._run(results, len(order), use_tqdm)
        except BaseException as exc:
            if self.engine.has_failed_step:  # the executor raised: settle the step it left in flight
                self.engine.fail_all(f"the engine step failed: {type(exc).__name__}: {exc}",
                                     kv_lost=isinstance(exc, ExecutorFailure))  # shards died with their KV
            for rid in order:
                self.engine.abort(rid)
            raise
        return [results[rid] for rid in order]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        pooling: Pooling | None = None,
        use_tqdm: bool = True,
    ) -> list[list[float]]:
        """One embedding per prompt (strings or token-id lists), in input order.

        Each prompt runs through the engine's prefill as ``generate``'s do (batched, chunked, under
        the token budget) and its final hidden states (after the model's final norm) are pooled
        into one float vector; nothing is generated and no KV stays cached. ``pooling``: None is
        the engine's (``EngineConfig.pooling``: ``embedding_pooling``, ``embedding_normalize``).
        """
        params = SamplingParams(pooling=self.config.pooling if pooling is None else pooling)
        outs = self.generate(_prompt_list(prompts), params, use_tqdm=use_tqdm)
        vectors: list[list[float]] = []
        for out in outs:
            seq = out.outputs[0]
            if seq.embedding is None:  # only an error ends an embedding request here without its vector
                raise RuntimeError(f"request {out.request_id} ended ({seq.finish_reason}) without an embedding: "
                                   f"{seq.error}")
            vectors.append(seq.embedding)
        return vectors

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [chat_ids(self.tokenizer, conv) for conv in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, results: dict[str, RequestOutput], total: int, use_tqdm: bool) -> None:
        bar = tqdm(total=total, desc="generate", unit="req", disable=not use_tqdm)
        done = 0
        try:
            while self.engine.has_unfinished:
                for delta in self.engine.step():
                    out = results[delta.request_id]
                    out.apply(delta)
                    if delta.finish_reason is not None and out.finished:
                        done += 1
                        bar.update(1)
        finally:
            bar.close()
        assert done == total, f"{total - done} requests did not finish"


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string or a token-id list) or a sequence of them, as a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)
