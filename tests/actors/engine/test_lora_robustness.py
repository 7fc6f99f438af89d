"""LoRA in the engine where it used to break: oversized files, unloads of an idle engine, MoE bases, memory.

An adapter file larger than any adapter of rank up to ``max_lora_rank`` on
the base could be is refused before it is read, naming the adapter and not
the server's folder; an unload whose last request is aborted (or ended by a
failed step) completes without another step; unload then load of one name
with a step in flight reloads at once unless the old adapter still serves; a
mixture-of-experts base serves attention adapters (against PEFT) and refuses
expert targets by name; the LoRA slots exist before the free memory that
sizes the KV pool is measured; an evicted adapter is read again off the step
loop's event loop, and a read that fails or is slow ends only its requests.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar

import pytest
import ray
import torch
from safetensors.torch import save_file

import actors.load.lora_adapter as lora_adapter
import actors.runner.model_runner as model_runner
from actors.api import SequenceDelta
from actors.commands import Command, PrepareLoRAs
from actors.errors import ExecutorFailure, LoRAUnloadingError
from actors.load.embedded import build_tokenizer
from actors.remote.ray_executor import RayExecutor
from actors.runner.lora_manager import LoRAManager
from actors.scheduler.step_loop import StepLoop
from apps.llm import LLM
from scheduling.batch import Batch, StepOutput
from scheduling.errors import InvalidParameterError
from scheduling.sampling_params import SamplingParams
from tests.actors.checkpoints import FAMILY_CONFIGS, write_checkpoint
from tests.actors.engine.test_engine_oracle import assert_pool_clean
from tests.actors.lora_fixtures import PROJECTION_SETS, make_peft_adapter, peft_greedy

R = TypeVar("R")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENGINE = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 256, "dtype": "float32",
          "device": "cpu", "enable_lora": True, "max_lora_rank": 8}  # fmt: skip
CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(4, 24))] for _ in range(n)]


def _sparse(file: Path, size: int) -> None:
    """A file of ``size`` bytes that takes no disk space (a hole)."""
    with open(file, "wb") as f:
        f.truncate(size)


def test_oversized_adapter_files_are_refused_before_they_are_read(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(tiny_dir), **ENGINE)

    def read(*args: object, **kwargs: object) -> dict[str, torch.Tensor]:
        raise AssertionError("the weights file was read")

    monkeypatch.setattr(lora_adapter, "load_file", read)
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / lora_adapter.CONFIG_FILE).write_text(json.dumps(CONFIG))
    _sparse(huge / lora_adapter.WEIGHTS_FILE, 64 << 30)
    config = tmp_path / "config"
    config.mkdir()
    _sparse(config / lora_adapter.CONFIG_FILE, 16 << 20)  # above MAX_CONFIG_BYTES
    for name, folder, file in (("huge", huge, lora_adapter.WEIGHTS_FILE), ("cfg", config, lora_adapter.CONFIG_FILE)):
        with pytest.raises(InvalidParameterError) as err:
            llm.load_lora(name, str(folder))
        message = str(err.value)
        assert err.value.param == "lora_path" and f"adapter {name!r}" in message and file in message, message
        assert str(tmp_path) not in message  # the folder is the server's to know
    # Within the size bound, yet not this model's adapter: its header alone is read, and names the tensor.
    hidden = json.loads((tiny_dir / "config.json").read_text())["hidden_size"]
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    wide = _write(tmp_path / "wide", {key.format("A"): torch.zeros(8, 3 * hidden),
                                      key.format("B"): torch.zeros(hidden, 8)})  # fmt: skip
    with pytest.raises(InvalidParameterError) as err:
        llm.load_lora("wide", str(wide))
    message = str(err.value)
    assert f"lora_A is [8, {3 * hidden}]" in message and f"[8, {hidden}]" in message, message
    assert err.value.param == "lora_path" and str(tmp_path) not in message
    assert llm.engine.loras.adapters == {}


@pytest.mark.parametrize("end", ["abort", "failed step", "failed executor"])
def test_an_unload_completes_when_its_last_request_is_aborted(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """Aborted, or ended by a failed step (``fail_step``) or executor (``fail_all``): the engine is idle after,
    no step comes to finish the unload."""
    adapter = make_peft_adapter(tiny_dir, tmp_path / "a", targets=PROJECTION_SETS["qv"], rank=8, alpha=16, seed=3)
    llm = LLM(str(tiny_dir), **ENGINE)
    llm.load_lora("a", str(adapter))
    engine = llm.engine
    prompt = _prompts(1, 1)[0]
    engine.add_request("r", prompt, replace(GREEDY, max_tokens=50, lora="a"), prompt_token_ids=prompt)
    engine.step()
    llm.unload_lora("a")
    assert "a" in engine.loras.adapters  # its request still runs on it
    if end == "abort":
        engine.abort("r")
    else:
        batch = engine.schedule()
        assert batch is not None

        def fail(batch: Batch) -> StepOutput:
            raise RuntimeError("the forward failed")

        monkeypatch.setattr(engine.executor, "execute", fail)
        with pytest.raises(RuntimeError):
            engine.execute(batch)
        ended = engine.fail_step("failed") if end == "failed step" else engine.fail_all("failed", kv_lost=True)
        assert [(d.request_id, d.finish_reason) for d in ended] == [("r", "error")]
        monkeypatch.undo()
    assert "a" not in engine.loras.adapters and not engine.has_unfinished
    llm.load_lora("a", str(adapter))  # the name is free again
    assert_pool_clean(llm)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE, layer 0 sparse and layer 1 dense (``tests.actors.checkpoints.qwen3_moe_config``)."""
    folder = write_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), FAMILY_CONFIGS["qwen3_moe"](), seed=5)
    build_tokenizer().save_pretrained(folder)
    return folder


def _write(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    (folder / lora_adapter.CONFIG_FILE).write_text(json.dumps(CONFIG))
    save_file(tensors, str(folder / lora_adapter.WEIGHTS_FILE))
    return folder


def test_a_moe_base_serves_attention_adapters_and_refuses_expert_targets(moe_dir: Path, tmp_path: Path) -> None:
    adapter = make_peft_adapter(moe_dir, tmp_path / "attn", targets=PROJECTION_SETS["attention"], rank=8,
                                alpha=16, seed=4)  # fmt: skip
    llm = LLM(str(moe_dir), **ENGINE)  # used to fail here: an AttributeError on the MoE layer's mlp
    llm.load_lora("attn", str(adapter))
    prompts = _prompts(2, 3)
    want = [tokens for tokens, _ in peft_greedy(moe_dir, adapter, prompts, GREEDY.max_tokens)]
    base = [tokens for tokens, _ in peft_greedy(moe_dir, None, prompts, GREEDY.max_tokens)]
    assert want != base  # the adapter changes the tokens
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora="attn")]
    assert got == want
    a, b = torch.zeros(8, 64), torch.zeros(64, 8)  # refused before their shapes are compared with the model's
    key = "base_model.model.model.layers.{}.mlp.{}.lora_{}.weight"
    refusals = {"dense_mlp_in_moe_layer": ({key.format(0, "gate_proj", "A"): a, key.format(0, "gate_proj", "B"): b},
                                           "gate_proj in layer 0, which has no such dense projection"),
                "experts": ({key.format(0, "experts.0.gate_proj", "A"): a,
                             key.format(0, "experts.0.gate_proj", "B"): b}, "mixture-of-experts layer's experts")}
    for name, (tensors, why) in refusals.items():
        with pytest.raises(InvalidParameterError) as err:
            llm.load_lora(name, str(_write(tmp_path / name, tensors)))
        assert err.value.param == "lora_path" and why in str(err.value), err.value
    assert set(llm.engine.loras.adapters) == {"attn"}
    assert_pool_clean(llm)


def test_lora_slots_exist_before_the_memory_that_sizes_the_kv_pool_is_measured(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    measure = model_runner.available_memory_bytes

    class Recorded(LoRAManager):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            events.append("lora slots")

    def measured(device: torch.device | str) -> int:
        events.append("free memory measured")
        return measure(device)

    monkeypatch.setattr(model_runner, "LoRAManager", Recorded)
    monkeypatch.setattr(model_runner, "available_memory_bytes", measured)
    LLM(str(tiny_dir), **ENGINE)
    assert events == ["lora slots", "free memory measured"]


@pytest.mark.parametrize("change", ["deleted", "replaced"])
def test_an_evicted_adapter_that_cannot_be_read_again_ends_only_its_requests(
    tiny_dir: Path, tmp_path: Path, change: str
) -> None:
    """Its files gone, or replaced by another valid adapter's (whose weights would be served under the KV
    key of the files it was loaded from): only its requests end, with an error naming it."""
    made = {name: make_peft_adapter(tiny_dir, tmp_path / name, targets=PROJECTION_SETS["qv"], rank=8, alpha=16,
                                    seed=seed) for name, seed in (("a", 5), ("b", 6))}  # fmt: skip
    prompts = _prompts(3, 2)
    alone = LLM(str(tiny_dir), **ENGINE)
    alone.load_lora("b", str(made["b"]))
    want = {"base": alone.generate([prompts[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids,
            "b": alone.generate([prompts[1]], GREEDY, use_tqdm=False, lora="b")[0].outputs[0].token_ids}
    llm = LLM(str(tiny_dir), **{**ENGINE, "max_loras": 1, "max_cpu_loras": 1})
    llm.load_lora("a", str(made["a"]))
    llm.load_lora("b", str(made["b"]))  # the host cache holds one adapter: a is evicted, read again when used
    weights = made["a"] / lora_adapter.WEIGHTS_FILE
    if change == "deleted":
        weights.unlink()
    else:  # a valid adapter of the same shapes copied over a's: readable, but not what a was loaded from
        shutil.copyfile(made["b"] / lora_adapter.WEIGHTS_FILE, weights)
    engine = llm.engine
    for rid, prompt, lora in (("ra", prompts[1], "a"), ("rb", prompts[1], "b"), ("base", prompts[0], None)):
        engine.add_request(rid, prompt, replace(GREEDY, lora=lora), prompt_token_ids=prompt)
    got: dict[str, list[int]] = {}
    ends: dict[str, tuple[str | None, str | None]] = {}
    for _ in range(4 * GREEDY.max_tokens):  # bounded: each step advances every running request
        if not engine.has_unfinished:
            break
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finish_reason is not None:
                ends[d.request_id] = (d.finish_reason, d.error)
    assert ends["ra"][0] == "error" and "'a'" in (ends["ra"][1] or ""), ends
    assert ("changed since it was loaded" in (ends["ra"][1] or "")) == (change == "replaced"), ends
    assert str(tmp_path) not in (ends["ra"][1] or "")  # the folder is the server's to know
    assert ends["rb"][0] == ends["base"][0] == "length"
    assert got["rb"] == want["b"] and got["base"] == want["base"]
    assert "a" in engine.loras.adapters  # still registered: its next request is tried (and refused) alike
    assert_pool_clean(llm)


def test_a_folder_change_reloads_at_once_unless_the_old_adapter_still_serves(tiny_dir: Path, tmp_path: Path) -> None:
    """Unload then load of one name (``ReplicaLoRAs.resolve`` after a folder change) with a step in flight, as
    on a busy replica: the old adapter goes at once when nothing uses it, else the load is refused as
    retryable, naming ``lora_name``, until its requests end."""
    old, new = (make_peft_adapter(tiny_dir, tmp_path / name, targets=PROJECTION_SETS["qv"], rank=8, alpha=16,
                                  seed=seed) for name, seed in (("old", 3), ("new", 4)))  # fmt: skip
    llm = LLM(str(tiny_dir), **ENGINE)
    engine = llm.engine
    old_key = llm.load_lora("a", str(old)).key
    prompts = _prompts(4, 2)
    long = replace(GREEDY, max_tokens=50)
    engine.add_request("base", prompts[0], long, prompt_token_ids=prompts[0])
    engine.add_request("ra", prompts[1], replace(long, lora="a"), prompt_token_ids=prompts[1])
    batch = engine.schedule()  # in flight from here to finish_step
    assert batch is not None
    engine.loras.remove("a")
    with pytest.raises(LoRAUnloadingError) as err:  # "ra" still runs on the old weights
        engine.loras.add("a", str(new))
    assert err.value.param == "lora_name" and "retry" in str(err.value)
    engine.abort("ra")
    with pytest.raises(LoRAUnloadingError):  # the forward in flight still writes or reads its slot
        engine.loras.add("a", str(new))
    engine.finish_step(batch, engine.execute(batch))
    engine.loras.add("a", str(old))  # nothing uses it now: reloadable, no step in flight needed
    batch = engine.schedule()  # a base-model step in flight
    assert batch is not None
    engine.loras.remove("a")
    info = engine.loras.add("a", str(new))  # the old one went first
    assert info.key != old_key and engine.loras.serving() == ["a"]
    engine.finish_step(batch, engine.execute(batch))
    engine.abort("base")
    assert_pool_clean(llm)


def test_an_evicted_adapter_is_read_off_the_event_loop_and_a_failed_read_ends_only_its_requests(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """In the step loop the adapter is read on the engine's thread with the lock free (the service answers
    meanwhile), and a read that fails ends its requests alone: the executor is not restarted."""
    made = {name: make_peft_adapter(tiny_dir, tmp_path / name, targets=PROJECTION_SETS["qv"], rank=8, alpha=16,
                                    seed=seed) for name, seed in (("a", 5), ("b", 6))}  # fmt: skip
    llm = LLM(str(tiny_dir), **{**ENGINE, "max_loras": 1, "max_cpu_loras": 1})
    llm.load_lora("a", str(made["a"]))
    llm.load_lora("b", str(made["b"]))  # a is evicted from the host cache: the step reads it again
    (made["a"] / lora_adapter.WEIGHTS_FILE).unlink()
    engine = llm.engine
    gate, reading = threading.Event(), threading.Event()
    seen: dict[str, object] = {}
    read = engine.executor.command

    def slow_read(cmd: Command[R]) -> R:
        if isinstance(cmd, PrepareLoRAs):
            seen["thread"] = threading.get_ident()
            reading.set()
            seen["opened"] = gate.wait(10.0)  # a loop blocked by this read could never open it: 10 s, then on
        return read(cmd)

    engine.executor.command = slow_read  # type: ignore[method-assign]
    deltas: list[SequenceDelta] = []
    prompts = _prompts(5, 2)

    async def serve() -> None:
        with ThreadPoolExecutor(1) as thread:
            loop = StepLoop(engine, thread, deltas.extend, lambda: None)
            loop.start()
            async with loop.lock:
                engine.add_request("ra", prompts[0], replace(GREEDY, lora="a"), prompt_token_ids=prompts[0])
            loop.wake()
            deadline, delay = time.monotonic() + 30.0, 0.01
            while not reading.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.2)
            async with loop.lock:  # free while the adapter is read: requests come in meanwhile
                engine.add_request("base", prompts[1], GREEDY, prompt_token_ids=prompts[1])
            seen["loop"] = threading.get_ident()
            gate.set()
            loop.wake()
            delay = 0.01
            while {"ra", "base"} - {d.request_id for d in deltas if d.finish_reason} and time.monotonic() < deadline:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.2)
            seen["health"] = loop.health.ok
            loop.stop()
            loop.wake()
            await loop.wait_stopped(10.0)

    try:
        asyncio.run(serve())
    finally:
        gate.set()
    assert seen["opened"] is True and seen["thread"] != seen["loop"] and seen["health"] is True, seen
    ends = {d.request_id: (d.finish_reason, d.error) for d in deltas if d.finish_reason}
    assert ends["ra"][0] == "error" and "'a'" in (ends["ra"][1] or "") and ends["base"] == ("length", None), ends
    assert "a" in engine.loras.adapters and not engine.has_unfinished
    assert_pool_clean(llm)


class _Ref:
    """A stand-in ObjectRef: what a shard's ``command(PrepareLoRAs)`` call answers (None: it has not answered yet)."""

    def __init__(self, answer: dict[str, str] | BaseException | None) -> None:
        self.answer = answer


def test_a_shard_read_that_raises_or_is_slow_fails_its_adapters_not_the_group(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """``RayExecutor.command(PrepareLoRAs)``: only a dead shard is an ``ExecutorFailure`` (the group torn down)."""
    ray_was_up = ray.is_initialized()  # the session's shared cluster may be up; the stand-ins must not touch it

    def wait(refs: list[_Ref], num_returns: int, timeout: float) -> tuple[list[_Ref], list[_Ref]]:
        return [r for r in refs if r.answer is not None], [r for r in refs if r.answer is None]

    def get(ref: _Ref) -> dict[str, str]:
        if isinstance(ref.answer, BaseException):
            raise ref.answer
        assert ref.answer is not None
        return ref.answer

    killed: list[object] = []
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)
    # The real ray.kill would start a local Ray (its API auto-initialises) and leave it to the next module.
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))
    raised = ray.exceptions.RayTaskError("command", "Traceback ...", MemoryError("no memory"))
    died = ray.exceptions.ActorDiedError()

    def executor(*answers: dict[str, str] | BaseException | None) -> RayExecutor:
        ex = RayExecutor.__new__(RayExecutor)  # no cluster: the shards are stand-ins
        ex._shards = [SimpleNamespace(command=SimpleNamespace(remote=lambda cmd, a=a: _Ref(a)))
                      for a in answers]  # fmt: skip
        ex._channel, ex._pg, ex.start_timeout_s = None, None, 5.0
        return ex

    prepare = PrepareLoRAs(("a", "b"))
    assert executor({}, {"b": "gone"}).command(prepare) == {"b": "gone"}
    slow: tuple[dict[str, str] | BaseException | None, ...]
    for slow in (({}, raised), ({}, None)):  # a read that raised, one not done in time
        ex = executor(*slow)
        failed = ex.command(prepare)
        assert set(failed) == {"a", "b"} and ex.shards, (slow, failed)
    assert killed == []  # no failed read tore the group down
    ex = executor({}, died)
    shards = list(ex.shards)
    with pytest.raises(ExecutorFailure, match="rank 1"):
        ex.command(prepare)
    assert not ex.shards and killed == shards
    # A real Ray call on a stand-in would have started Ray here (or, with it up, failed on the stand-in).
    assert ray.is_initialized() == ray_was_up
