"""Step 23's figures (issue 40): flotilla on a CUDA device against the bandwidth limit and HF transformers.

``scripts/gpu_check.sh`` runs it (after installing the wheel folder and
setting PYTHONPATH to the repo); by hand, from the repo root::

    PYTHONPATH=. python scripts/gpu_bench.py --out OUT/gpu_check.json --deadline-s 300
    PYTHONPATH=. python scripts/gpu_bench.py --out /tmp/gpu_check.json --deadline-s 60 --dry-run

Three phases, each in a time box (shares of ``--deadline-s``; time a phase
leaves unused goes to the next). A measurement that the box has no time
left for, or that fails, is recorded as null with its reason; the report
(``scripts/gpu_report.py`` names its keys) is rewritten after every
measurement, so a run killed from outside keeps what it had.

1. ``correctness``: FlashInfer against the torch backend on randomized steps
   of tests/kvcache/attention/test_flashinfer_backend.py (``Pair.run_workload``: mixed
   prefill/decode, chunked, prefix hits) at both models' head shapes in bf16 (the first
   FlashInfer use: its JIT compiles here); the embedded ``tiny`` model's
   greedy tokens against HF transformers' in fp32 (torch backend: FlashInfer
   computes in fp16/bf16 only) and in bf16 (FlashInfer); every KV page free
   after aborting requests mid-prefill and mid-decode; the host syncs of one
   decode step (``torch.cuda.set_sync_debug_mode``).
2. ``decode``: random-weight models shaped like Llama-3.2-1B and Llama-3-8B
   in bf16 on FlashInfer, prompts of ``context`` tokens, then decode steps
   timed on the host after a device sync: batch 1 on both shapes, then the
   1B shape at batch 16, 64 and 256; each with ``cuda_graphs`` on and off,
   passed explicitly (on the dry run's CPU, "on" runs the same static
   buffers eagerly: the path is checked, not its speed).
3. ``hf_peer``: HF ``generate`` (greedy) on the same weights and batches;
   a logits processor notes the time of every step (``StepClock``), so the
   same decode steps as flotilla's are timed, after the same warm-up ones.

Figures per entry: ``tok_per_s`` (output tokens per second over the timed
steps), ``mbu`` = (weight bytes + KV bytes read per step) / step time /
``PEAK_BANDWIDTH``, ``roofline_fraction`` = max(those bytes /
``PEAK_BANDWIDTH``, the step's FLOPs / ``PEAK_BF16_FLOPS``) / step time.

``--dry-run``: the same code on the CPU, the FlashInfer CPU emulator
(tests/kvcache/flashinfer_emulator.py, passed as
``EngineConfig.attention_kernels``) in place of the kernels, and tiny models
of the same architecture (``Shape.tiny``): the report's figures are that
run's, against the same H200 constants, so they check the arithmetic and the
report, not the speed of anything.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import math
import random
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from gpu_report import Entry, Json, skeleton, write_report
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
)

from actors.engine.llm_engine import LLMEngine
from actors.load.embedded import build_tokenizer, ensure_embedded_model
from apps.llm import LLM
from cli.plan.hardware import GPUS
from kvcache.attention.flashinfer import (
    FlashInferKernels,
    load_flashinfer,
)
from scheduling.sampling_params import SamplingParams
from tests.kvcache import flashinfer_emulator
from tests.kvcache.attention.test_flashinfer_backend import Pair

# Issue 40's reference machine (cli.plan.hardware.GPUS holds its bandwidth and bf16 rate).
# MBU and the roofline are against these.
REFERENCE_CARD = "H200"
PEAK_BANDWIDTH = GPUS[REFERENCE_CARD].bandwidth_bytes_per_s
PEAK_BF16_FLOPS = GPUS[REFERENCE_CARD].bf16_flops

PAGE_SIZE = 16
BF16_BYTES = 2

_T0 = time.monotonic()


def log(message: str) -> None:
    print(f"[gpu_bench {time.monotonic() - _T0:6.1f}s] {message}", flush=True)


# --------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    """A Llama architecture; its bytes and FLOPs per decode step."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    rope: dict[str, float | str]
    max_positions: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.max_positions, rms_norm_eps=1e-5, tie_word_embeddings=self.tied,
            rope_parameters=dict(self.rope), bos_token_id=1, eos_token_id=2,
        )  # fmt: skip

    def layer_linear_params(self) -> int:
        h, d = self.hidden, self.head_dim
        attention = h * self.heads * d * 2 + h * self.kv_heads * d * 2  # q and o, k and v
        return attention + 3 * h * self.intermediate  # gate, up, down

    def matmul_params(self) -> int:
        """Weights a decode step multiplies by: every layer's linears and the LM head."""
        return self.layers * self.layer_linear_params() + self.vocab * self.hidden

    def weight_bytes_per_step(self) -> int:
        """Weights a decode step reads: the matmul weights and the norms (the embedding gives one row per token)."""
        norms = (2 * self.layers + 1) * self.hidden
        return (self.matmul_params() + norms) * BF16_BYTES

    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * BF16_BYTES

    def flops_per_step(self, batch: int, context_sum: float) -> float:
        """Matmuls (2 per weight per token) and attention (q.k and p.v over every cached key)."""
        return 2 * self.matmul_params() * batch + 4 * self.layers * self.heads * self.head_dim * context_sum

    def tiny(self) -> Shape:
        """The dry run's stand-in: the same architecture (GQA group of 4, tying, rope) at toy sizes."""
        return Shape(f"tiny-{self.name}", hidden=128, layers=2, heads=8, kv_heads=2, intermediate=256,
                     vocab=1024, tied=self.tied, rope=self.rope, max_positions=self.max_positions)  # fmt: skip


LLAMA_1B = Shape(
    "llama-3.2-1b", hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256, tied=True,
    rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    max_positions=131072,
)  # fmt: skip
LLAMA_8B = Shape(
    "llama-3-8b", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, tied=False,
    rope={"rope_type": "default", "rope_theta": 500000.0}, max_positions=8192,
)  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """What one run measures: the device's sizes, or the dry run's."""

    device: torch.device
    dry_run: bool
    small: Shape
    large: Shape
    context: int
    warmup_steps: int
    decode_steps: int
    throughput_batches: tuple[int, ...]
    attention_heads: tuple[tuple[int, int, int], ...]  # (query heads, kv heads, head dim)
    greedy_tokens: int
    kernels: FlashInferKernels | ModuleType

    @property
    def engine_kwargs(self) -> dict[str, object]:
        """The engine on FlashInfer: the real kernels on CUDA, the emulator on the dry run's CPU."""
        kwargs: dict[str, object] = {"device": self.device.type, "attention_backend": "flashinfer"}
        if self.dry_run:
            kwargs["attention_kernels"] = self.kernels
        return kwargs

    def graph_modes(self) -> tuple[bool, ...]:
        """Both, always passed (the default is on, on CUDA: leaving it out would mislabel a figure)."""
        return (True, False)


def make_plan(dry_run: bool) -> Plan:
    if dry_run:
        return Plan(torch.device("cpu"), True, LLAMA_1B.tiny(), LLAMA_8B.tiny(), context=32, warmup_steps=2,
                    decode_steps=8, throughput_batches=(2, 4), attention_heads=((8, 2, 16),), greedy_tokens=8,
                    kernels=flashinfer_emulator)  # fmt: skip
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench: no CUDA device (torch.cuda.is_available() is False); "
                         "use --dry-run for the CPU run")  # fmt: skip
    heads = tuple(sorted({(s.heads, s.kv_heads, s.head_dim) for s in (LLAMA_1B, LLAMA_8B)}))
    return Plan(torch.device("cuda"), False, LLAMA_1B, LLAMA_8B, context=1024, warmup_steps=3, decode_steps=32,
                throughput_batches=(16, 64, 256), attention_heads=heads, greedy_tokens=32,
                kernels=load_flashinfer())  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- report and time boxes
class Report:
    """The report dict, rewritten to disk after every change."""

    def __init__(self, path: Path, dry_run: bool) -> None:
        self.path = path
        self.data = skeleton(dry_run=dry_run)
        self.save()

    def save(self) -> None:
        write_report(self.path, self.data)

    def _list(self, key: str) -> list[Json]:
        value = self.data[key]
        assert isinstance(value, list)
        return value

    def _dict(self, key: str) -> dict[str, Json]:
        value = self.data[key]
        assert isinstance(value, dict)
        return value

    def note(self, text: str) -> None:
        log(f"note: {text}")
        self._list("notes").append(text)
        self.save()

    def add_entry(self, key: str, entry: Entry) -> None:
        self._list(key).append(entry.to_json())
        self.save()

    def correctness(self, key: str, value: Json, reason: str | None = None) -> None:
        correctness = self._dict("correctness")
        correctness[key] = value
        reasons = correctness["reasons"]
        assert isinstance(reasons, dict)
        if reason is not None:
            reasons[key] = reason
        self.save()

    def correctness_value(self, key: str) -> Json:
        return self._dict("correctness")[key]

    def phase(self, name: str, status: str, seconds: float) -> None:
        self._dict("phases")[name] = {"status": status, "seconds": round(seconds, 1)}
        self.save()


class TimeBox:
    """A phase's deadline, and whether something in it failed or was cut."""

    def __init__(self, name: str, seconds: float) -> None:
        self.name, self.seconds = name, seconds
        self.deadline = time.monotonic() + seconds
        self.failed = self.cut = False

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def cut_reason(self) -> str | None:
        """None while time is left; else the reason recorded for what is not measured."""
        if self.left() > 0:
            return None
        self.cut = True
        return f"the {self.name} time box ({self.seconds:.0f} s) ran out before this measurement"

    def status(self) -> str:
        return "failed" if self.failed else "timed_out" if self.cut else "ok"


def failure_reason(box: TimeBox, what: str, exc: BaseException) -> str:
    box.failed = True
    log(f"{what} failed:\n{traceback.format_exc()}")
    return f"{what} failed: {type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- models
def write_random_llama(folder: Path, shape: Shape, device: torch.device, seed: int) -> Path:
    """A Hugging Face folder of bf16 random weights for ``shape`` (drawn on ``device``) and the byte tokenizer."""
    config = shape.config()
    with torch.device("meta"):
        names = {name: tuple(p.shape) for name, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, dims in names.items():
        values = torch.randn(dims, generator=gen, device=device)
        if name.endswith("norm.weight"):
            values = 1.0 + 0.05 * values
        elif "embed_tokens" not in name:
            values = values / math.sqrt(dims[-1])  # unit-variance activations through every layer
        tensors[name] = values.to(torch.bfloat16).cpu()
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    # Prompts are token ids and decoding reads ids only: the byte tokenizer stands in for Llama's.
    build_tokenizer().save_pretrained(folder)
    return folder


class Models:
    """Random-weight model folders under one work folder, written on first use."""

    def __init__(self, root: Path, device: torch.device) -> None:
        self.root, self.device = root, device
        self.folders: dict[str, Path] = {}

    def folder(self, shape: Shape) -> Path:
        if shape.name not in self.folders:
            log(f"writing random bf16 weights for {shape.name} ({shape.weight_bytes_per_step() / 1e9:.2f} GB read per step)")
            self.folders[shape.name] = write_random_llama(self.root / shape.name, shape, self.device, seed=0)
            release_memory(self.device)
        return self.folders[shape.name]


@contextmanager
def work_folder(device: torch.device) -> Iterator[Path]:
    """A temporary folder for the model files: in RAM (/dev/shm) on the device, where there is room."""
    shm = Path("/dev/shm")
    in_ram = device.type == "cuda" and shm.is_dir() and shutil.disk_usage(shm).free > 40e9
    with tempfile.TemporaryDirectory(prefix="flotilla-gpu-bench-", dir=str(shm) if in_ram else None) as tmp:
        log(f"model files under {tmp}")
        yield Path(tmp)


def hf_model(folder: Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, device_map=str(device))
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"{folder} loaded as {type(model).__name__}, not LlamaForCausalLM")
    return model.eval()


# --------------------------------------------------------------------------- measurements
def entry(shape: Shape, batch: int, context: int, graphs: bool, reason: str | None = None) -> Entry:
    """An entry with nothing measured (yet, or ever: then ``reason`` says why)."""
    return Entry(shape=shape.name, batch=batch, context=context, cuda_graphs=graphs, reason=reason)


def measured(shape: Shape, batch: int, context: int, graphs: bool, steps: int, seconds: float,
             mean_context: float) -> Entry:  # fmt: skip
    """The figures of ``steps`` decode steps of ``batch`` sequences over ``seconds``, attending over
    ``mean_context`` keys on average."""
    step_s = seconds / steps
    read = shape.weight_bytes_per_step() + batch * mean_context * shape.kv_bytes_per_token()
    roofline_s = max(read / PEAK_BANDWIDTH, shape.flops_per_step(batch, batch * mean_context) / PEAK_BF16_FLOPS)
    return Entry(shape=shape.name, batch=batch, context=context, cuda_graphs=graphs,
                 tok_per_s=significant(batch / step_s), mbu=significant(read / step_s / PEAK_BANDWIDTH),
                 roofline_fraction=significant(roofline_s / step_s), step_ms=significant(step_s * 1e3))  # fmt: skip


def significant(x: float) -> float:
    """Four significant digits: the dry run's figures are tiny, the device's large."""
    return float(f"{x:.4g}")


def pages_all_free(engine: LLMEngine) -> tuple[bool, str]:
    """Whether every page is free or only cached (evictable), none locked, the allocator consistent."""
    sched = engine.policy
    cache = sched.cache
    evictable = cache.num_evictable_pages if cache is not None else 0
    locked = cache.num_locked_pages if cache is not None else 0
    sched.allocator.check_integrity()
    free = sched.allocator.num_free_pages
    ok = locked == 0 and free + evictable == sched.allocator.num_pages and not engine.has_unfinished
    return ok, f"{free} free + {evictable} cached of {sched.allocator.num_pages}, {locked} locked"


def prefill_budget(plan: Plan) -> int:
    """Tokens per engine step: a few whole prompts per prefill step."""
    return max(2048, 8 * plan.context)


def decode_room(plan: Plan, batch: int) -> int:
    """Tokens a sequence may sample: the prefill of the whole batch (sequences that finish theirs
    first decode beside the later ones, one token per step), the warm-up and the timed steps."""
    prefill_steps = math.ceil(batch * plan.context / prefill_budget(plan))
    return 2 * prefill_steps + plan.warmup_steps + plan.decode_steps + 8


def engine_decode(llm: LLM, shape: Shape, plan: Plan, batch: int, graphs: bool, rng: random.Random) -> Entry:
    """Prefill ``batch`` prompts of ``plan.context`` tokens, then time decode steps of the whole batch."""
    engine = llm.engine
    params = SamplingParams(max_tokens=decode_room(plan, batch), temperature=0.0, ignore_eos=True)
    rids = [f"bench-{batch}-{i}" for i in range(batch)]
    for rid in rids:
        prompt = [rng.randrange(3, shape.vocab) for _ in range(plan.context)]
        engine.add_request(rid, prompt, params, prompt_token_ids=prompt)
    try:
        generated = dict.fromkeys(rids, 0)
        prefill_steps = 0
        while not all(generated.values()):  # prefill (chunked as the engine likes) until every sequence decodes
            for d in engine.step():
                generated[d.request_id] += len(d.token_ids)
            prefill_steps += 1
            if prefill_steps > batch * plan.context:  # more steps than prompt tokens: the engine is stuck
                stuck = sum(1 for n in generated.values() if n == 0)
                raise RuntimeError(f"{stuck} of {batch} prompts never finished their prefill")
        for _ in range(plan.warmup_steps):
            for d in engine.step():
                generated[d.request_id] += len(d.token_ids)
        static = llm.engine.executor.runner.graphs  # type: ignore[attr-defined]
        if (static is not None) != graphs:
            raise RuntimeError(f"asked for cuda_graphs {graphs}, and the engine's static decode is {static}")
        replays = 0 if static is None else static.replays
        sync(plan.device)
        start = time.perf_counter()
        for _ in range(plan.decode_steps):
            deltas = engine.step()
            if len(deltas) != batch:
                raise RuntimeError(f"a decode step advanced {len(deltas)} of {batch} sequences")
        sync(plan.device)
        seconds = time.perf_counter() - start
        if static is not None and static.replays - replays != plan.decode_steps:
            raise RuntimeError(f"{static.replays - replays} of {plan.decode_steps} timed steps ran on the graphs")
    finally:
        for rid in rids:
            engine.abort(rid)
    free, detail = pages_all_free(engine)
    if not free:
        raise RuntimeError(f"pages still held after aborting the batch: {detail}")
    # A sequence with g tokens sampled feeds the last one, attending over context + g keys; sequences
    # that finished their prefill early have sampled more (their decodes ran beside later prefills).
    mean_generated = sum(generated.values()) / batch
    mean_context = plan.context + mean_generated + (plan.decode_steps - 1) / 2
    return measured(shape, batch, plan.context, graphs, plan.decode_steps, seconds, mean_context)


class StepClock(LogitsProcessor):
    """A logits processor that only notes the time: ``generate`` calls it once per new token.

    The first call comes after the prefill, each later one a decode step after the previous
    one; the device is synchronized first (``generate`` syncs every step for its stopping
    check anyway), so the gaps are the decode steps' times.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def hf_decode(model: LlamaForCausalLM, shape: Shape, plan: Plan, batch: int, rng: random.Random) -> Entry:
    """HF ``generate`` (greedy) on ``batch`` prompts: the time of its decode steps (``StepClock``)."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    ids = torch.randint(3, shape.vocab, (batch, plan.context), generator=gen).to(plan.device)
    new_tokens = 1 + plan.warmup_steps + plan.decode_steps
    clock = StepClock(plan.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([clock]))  # fmt: skip
    if out.shape != (batch, plan.context + new_tokens) or len(clock.times) != new_tokens:
        raise RuntimeError(f"generate returned {tuple(out.shape)} after {len(clock.times)} steps, "
                           f"not {(batch, plan.context + new_tokens)} after {new_tokens}")  # fmt: skip
    # Call i (0-based) follows the forward that attended over context + i keys; the timed
    # steps are the last decode_steps gaps, after the warm-up ones.
    timed = clock.times[-plan.decode_steps - 1 :]
    mean_context = plan.context + plan.warmup_steps + (plan.decode_steps + 1) / 2
    return measured(shape, batch, plan.context, False, plan.decode_steps, timed[-1] - timed[0], mean_context)


def engine_for(folder: Path, plan: Plan, graphs: bool, max_batch: int) -> LLM:
    max_len = plan.context + decode_room(plan, max_batch)
    pages = max_batch * math.ceil(max_len / PAGE_SIZE) + 64
    return LLM(str(folder), dtype="bfloat16", max_model_len=max_len, max_num_seqs=max(8, max_batch),
               max_num_batched_tokens=prefill_budget(plan), num_kv_pages=pages, page_size=PAGE_SIZE,
               cuda_graphs=graphs, **plan.engine_kwargs)  # fmt: skip


# --------------------------------------------------------------------------- phases
def greedy_prompts(seed: int) -> list[list[int]]:
    """The oracle's kind of prompt: byte ids of varied lengths, one shorter than a page, several spanning pages."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 13, 16, 31, 47, 80)]


def flotilla_greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def hf_greedy(model: LlamaForCausalLM, prompts: list[list[int]], tokens: int, device: torch.device) -> list[list[int]]:
    out: list[list[int]] = []
    for prompt in prompts:  # one at a time: no padding to differ from the engine's unpadded sequences
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False, pad_token_id=0)  # fmt: skip
        out.append(gen[0, len(prompt):].tolist())
    return out


def attention_diff(plan: Plan, heads: int, kv_heads: int, head_dim: int, seed: int) -> float:
    """Max abs difference, FlashInfer vs the torch backend in bf16, over the gpu test's own workload
    (``Pair.run_workload``: prefix hits, chunked prefill, mixed and decode steps, a shared prefix)."""
    pair = Pair((heads, kv_heads), PAGE_SIZE, torch.bfloat16, seed, kernels=plan.kernels,
                device=str(plan.device), head_dim=head_dim)  # fmt: skip
    pair.run_workload()
    return pair.worst


def run_correctness(plan: Plan, models: Models, box: TimeBox, report: Report) -> None:
    kernels_name = "the FlashInfer emulator" if plan.dry_run else "FlashInfer"
    # 1. Attention: FlashInfer vs the torch backend on randomized steps like the gpu test's.
    worst = 0.0
    try:
        for i, (heads, kv_heads, head_dim) in enumerate(plan.attention_heads):
            compiles = "" if plan.dry_run else " (FlashInfer's JIT compiles a head size on first use)"
            log(f"attention {kernels_name} vs torch, bf16, {heads}q/{kv_heads}kv x {head_dim}{compiles}")
            worst = max(worst, attention_diff(plan, heads, kv_heads, head_dim, seed=i))
        report.correctness("attention_max_abs_diff_bf16", worst)
        log(f"attention max abs diff (bf16): {worst:.3g}")
    except Exception as e:
        report.correctness("attention_max_abs_diff_bf16", None, failure_reason(box, "attention comparison", e))

    tiny = ensure_embedded_model("tiny", root=models.root / "embedded")
    prompts = greedy_prompts(seed=5)
    # 2. Greedy tokens against HF in fp32 (torch backend) and bf16 (FlashInfer).
    for key, dtype, backend in (("greedy_equal_fp32", torch.float32, {"attention_backend": "torch"}),
                                ("greedy_equal_bf16_fraction", torch.bfloat16, plan.engine_kwargs)):  # fmt: skip
        reason = box.cut_reason()
        if reason is not None:
            report.correctness(key, None, reason)
            continue
        try:
            log(f"{key}: tiny, {len(prompts)} prompts x {plan.greedy_tokens} tokens, flotilla vs HF")
            kwargs = {**backend, "device": plan.device.type}
            llm = LLM(str(tiny), dtype=str(dtype).removeprefix("torch."), max_model_len=512, **kwargs)
            ours = flotilla_greedy(llm, prompts, plan.greedy_tokens)
            llm.shutdown()
            del llm
            theirs = hf_greedy(hf_model(tiny, dtype, plan.device), prompts, plan.greedy_tokens, plan.device)
            release_memory(plan.device)
            equal = [a == b for a, b in zip(ours, theirs, strict=True)]
            value: Json = all(equal) if dtype == torch.float32 else round(sum(equal) / len(equal), 4)
            report.correctness(key, value)
            log(f"{key}: {value} ({sum(equal)}/{len(equal)} prompts equal)")
        except Exception as e:
            report.correctness(key, None, failure_reason(box, key, e))

    # 3. Pages after aborts mid-prefill (chunked) and mid-decode; 4. host syncs of a decode step.
    reason = box.cut_reason()
    if reason is not None:
        report.correctness("pages_free_after_abort", None, reason)
        report.correctness("host_syncs_per_decode_step", None, reason)
        return
    try:
        llm = LLM(str(tiny), dtype="bfloat16", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=32,
                  page_size=PAGE_SIZE, **plan.engine_kwargs)  # fmt: skip
        engine = llm.engine
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        rng = random.Random(7)
        rids = [f"abort-{i}" for i in range(6)]
        for rid in rids:
            prompt = [rng.randrange(3, 256) for _ in range(rng.randint(10, 100))]
            engine.add_request(rid, prompt, params, prompt_token_ids=prompt)
        decoding: set[str] = set()
        for _ in range(6):  # a 32-token budget: some sequences decode, others are still mid-prefill
            decoding.update(d.request_id for d in engine.step() if d.token_ids)
        if not 0 < len(decoding) < len(rids):
            raise RuntimeError(f"{len(decoding)} of {len(rids)} sequences decoding when aborted: "
                               "the check needs some mid-prefill and some mid-decode")  # fmt: skip
        for rid in rids:
            engine.abort(rid)
        free, detail = pages_all_free(engine)
        detail += f" after aborting {len(decoding)} decoding and {len(rids) - len(decoding)} mid-prefill"
        report.correctness("pages_free_after_abort", free, None if free else detail)
        log(f"pages after abort: {detail}")
        report.correctness("host_syncs_per_decode_step", *count_syncs(engine, plan))
        llm.shutdown()
    except Exception as e:
        reason = failure_reason(box, "abort check", e)
        for key in ("pages_free_after_abort", "host_syncs_per_decode_step"):
            if report.correctness_value(key) is None:
                report.correctness(key, None, reason)


def count_syncs(engine: LLMEngine, plan: Plan) -> tuple[Json, str | None]:
    """Host syncs CUDA reports over a few decode steps (each warns under sync debug mode), per step."""
    if plan.device.type != "cuda":
        return None, "CPU run: there is no CUDA stream to synchronize with"
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    engine.add_request("syncs", [5, 6, 7, 8], params, prompt_token_ids=[5, 6, 7, 8])
    engine.step()  # the prefill
    engine.step()
    steps = 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine.abort("syncs")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    log(f"host syncs over {steps} decode steps: {syncs}")
    return round(syncs / steps, 2), None


def run_decode(plan: Plan, models: Models, box: TimeBox, report: Report) -> None:
    rng = random.Random(11)
    # Batch 1 on both shapes first (the bandwidth figures), then the small shape's throughput.
    for shape, batches in ((plan.small, (1,)), (plan.large, (1,)), (plan.small, plan.throughput_batches)):
        for graphs in plan.graph_modes():
            todo = list(batches)
            reason = box.cut_reason()
            llm: LLM | None = None
            if reason is None:
                try:
                    log(f"{shape.name}: engine (cuda_graphs {graphs}) for batches {todo}")
                    llm = engine_for(models.folder(shape), plan, graphs, max(todo))
                except Exception as e:
                    reason = failure_reason(box, f"{shape.name} engine", e)
            for batch in todo:
                reason = reason or box.cut_reason()
                if reason is not None or llm is None:
                    report.add_entry("decode", entry(shape, batch, plan.context, graphs, reason))
                    continue
                try:
                    result = engine_decode(llm, shape, plan, batch, graphs, rng)
                    log(f"{shape.name} batch {batch} graphs {graphs}: {result.tok_per_s} tok/s, "
                        f"mbu {result.mbu}, roofline {result.roofline_fraction}")  # fmt: skip
                except Exception as exc:
                    why = failure_reason(box, f"{shape.name} batch {batch}", exc)
                    result = entry(shape, batch, plan.context, graphs, why)
                report.add_entry("decode", result)
            if llm is not None:
                llm.shutdown()
                del llm
                release_memory(plan.device)


def run_hf_peer(plan: Plan, models: Models, box: TimeBox, report: Report) -> None:
    rng = random.Random(13)
    # Batch 1 and the second throughput batch (64: issue 40 sets targets at 1 and 64) first, the
    # large shape next, the rest of the small shape's batches last.
    tb = plan.throughput_batches
    for shape, batches in ((plan.small, (1, *tb[1:2])), (plan.large, (1,)), (plan.small, (*tb[:1], *tb[2:]))):
        reason = box.cut_reason()
        model: LlamaForCausalLM | None = None
        if reason is None:
            try:
                log(f"{shape.name}: HF transformers model for batches {list(batches)}")
                model = hf_model(models.folder(shape), torch.bfloat16, plan.device)
            except Exception as e:
                reason = failure_reason(box, f"{shape.name} HF model", e)
        for batch in batches:
            reason = reason or box.cut_reason()
            if reason is not None or model is None:
                report.add_entry("hf_peer", entry(shape, batch, plan.context, False, reason))
                continue
            try:
                result = hf_decode(model, shape, plan, batch, rng)
                log(f"HF {shape.name} batch {batch}: {result.tok_per_s} tok/s, mbu {result.mbu}")
            except Exception as exc:
                result = entry(shape, batch, plan.context, False,
                               failure_reason(box, f"HF {shape.name} batch {batch}", exc))  # fmt: skip
            report.add_entry("hf_peer", result)
        del model
        release_memory(plan.device)


PHASES: tuple[tuple[str, float, Callable[[Plan, Models, TimeBox, Report], None]], ...] = (
    ("correctness", 0.30, run_correctness),
    ("decode", 0.45, run_decode),
    ("hf_peer", 0.25, run_hf_peer),
)


def device_info(plan: Plan) -> dict[str, Json]:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    info: dict[str, Json] = {
        "type": plan.device.type, "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": version("transformers"), "flashinfer": version("flashinfer-python"),
        "attention_kernels": "flashinfer emulator (CPU)" if plan.dry_run else "flashinfer",
        "python": sys.version.split()[0],
        "peak_bandwidth_bytes_per_s": PEAK_BANDWIDTH, "peak_bf16_flops": PEAK_BF16_FLOPS,
        "reference_card": REFERENCE_CARD,
    }  # fmt: skip
    if plan.device.type == "cuda":
        props = torch.cuda.get_device_properties(plan.device)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count)  # fmt: skip
    else:
        info["name"] = "cpu"
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the report JSON (rewritten after each measurement)")
    parser.add_argument("--deadline-s", type=float, required=True, help="end within this many seconds")
    parser.add_argument("--dry-run", action="store_true", help="CPU, FlashInfer emulator, tiny shapes")
    args = parser.parse_args(argv)
    deadline = _T0 + args.deadline_s
    report = Report(args.out, args.dry_run)
    plan = make_plan(args.dry_run)
    if plan.dry_run:
        # Toy matmuls run fastest on one thread, and a thread pool on a busy shared CPU spins.
        torch.set_num_threads(1)
    report.data["device"] = device_info(plan)
    report.save()
    log(f"device {report.data['device']}")
    if plan.device.type == "cuda" and REFERENCE_CARD not in torch.cuda.get_device_name(plan.device):
        report.note(f"MBU and roofline fractions are against the {REFERENCE_CARD}'s figures (issue 40); "
                    f"this card is {torch.cuda.get_device_name(plan.device)}")  # fmt: skip
    if plan.dry_run:
        report.note("dry run: CPU, the FlashInfer emulator, tiny shapes; the figures check the report, "
                    "not any speed")  # fmt: skip
    ok = True
    with work_folder(plan.device) as root:
        models = Models(root, plan.device)
        for i, (name, weight, run) in enumerate(PHASES):
            share = weight / sum(w for _, w, _ in PHASES[i:])
            box = TimeBox(name, max(0.0, deadline - time.monotonic()) * share)
            log(f"phase {name}: {box.seconds:.0f} s")
            report.phase(name, "running", 0.0)
            start = time.monotonic()
            try:
                run(plan, models, box, report)
            except Exception as e:
                failure_reason(box, f"phase {name}", e)
            report.phase(name, box.status(), time.monotonic() - start)
            ok = ok and box.status() == "ok"
            release_memory(plan.device)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
