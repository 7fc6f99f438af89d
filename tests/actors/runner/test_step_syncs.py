"""A model step waits for its device once: the read of what it sampled (and exported) at its end.

On the CPU, ``HostSyncCounter`` (``tests/actors/sync_guard.py``) counts the
calls in ``ModelRunner.execute`` that would make the host wait for a CUDA
device, for every kind of step on the embedded ``tiny`` model. The runner
takes the torch attention path a CUDA device takes (the native CPU decode
kernel off). A step that drafts (``DraftRunner.propose``) waits once more,
for all its drafts. On CUDA, the ``gpu`` test runs the same steps under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any
synchronising call; the one allowed read waits on a CUDA event, which that
mode does not flag (``kvcache.device_copy.to_host``).

``python -m tests.actors.runner.test_step_syncs`` prints the counts per step kind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

import actors.runner.sampler as sampler_module
from actors.commands import ReadExpertTokens
from actors.config import EngineConfig
from actors.load.embedded import ensure_embedded_model
from actors.runner.model_runner import ModelRunner
from kvcache import cpu_kernels, device_copy
from kvcache.attention.flashinfer import flashinfer_installed
from kvcache.attention.torch_paged import TorchPagedAttention
from kvcache.kv_transfer import KVPayload, RankPayloads
from scheduling.batch import Batch, BatchDrafts, BatchKVMoves, StepOutput, TokenMasks
from scheduling.sampling_params import SamplingParams
from scheduling.spec_config import SpeculativeConfig
from tests.actors.checkpoints import mixtral_config, write_checkpoint
from tests.actors.sync_guard import HostSyncCounter
from tests.kvcache import flashinfer_emulator

PAGE = 16
GREEDY = SamplingParams(temperature=0.0).sampler_view()
SAMPLED = [
    SamplingParams(temperature=0.9, top_p=0.8, seed=7).sampler_view(),  # nucleus past top-k's reach
    SamplingParams(temperature=1.1, top_k=5, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.2,
                   repetition_penalty=1.3, logit_bias=((5, 2.0), (9, -1.0))).sampler_view(),
    GREEDY,
]
LOGPROBS = [SamplingParams(temperature=0.0, logprobs=3).sampler_view(),
            SamplingParams(temperature=0.8, seed=3, logprobs=2).sampler_view(), GREEDY]


@dataclass
class _Seq:
    """One sequence of the scripted steps: its tokens so far and its pages."""

    tokens: list[int]
    pages: list[int]
    outputs: list[int] = field(default_factory=list)


def _prompt(n: int, salt: int) -> list[int]:
    return [(7 * i + salt) % 250 + 3 for i in range(n)]


def _batch(
    step: int,
    parts: list[tuple[_Seq, int, bool]],
    params: list[SamplingParams] | None = None,
    drafts: list[list[int]] | None = None,
    kv_moves: BatchKVMoves | None = None,
    token_masks: TokenMasks | None = None,
) -> Batch:
    """A step over ``parts``: (sequence, new tokens from its end, sampled?); greedy unless ``params``."""
    sampled = [seq for seq, _, s in parts if s]
    params = params or [GREEDY] * len(sampled)
    return Batch(
        step=step,
        input_ids=[t for seq, n, _ in parts for t in seq.tokens[len(seq.tokens) - n:]],
        positions=[p for seq, n, _ in parts for p in range(len(seq.tokens) - n, len(seq.tokens))],
        query_lens=[n for _, n, _ in parts],
        context_lens=[len(seq.tokens) for seq, _, _ in parts],
        page_tables=[seq.pages for seq, _, _ in parts],
        sample_indices=[i for i, (_, _, s) in enumerate(parts) if s],
        sampling_params=params,
        num_output_tokens=[len(seq.outputs) for seq in sampled],
        prompt_token_ids=[seq.tokens[: len(seq.tokens) - len(seq.outputs)] if p.needs_penalties else None
                          for seq, p in zip(sampled, params, strict=True)],
        output_token_ids=[list(seq.outputs) if p.needs_penalties else None
                          for seq, p in zip(sampled, params, strict=True)],
        drafts=BatchDrafts(drafts),
        kv_moves=kv_moves or BatchKVMoves(),
        token_masks=token_masks,
    )


def _mask_row(allowed: range, vocab: int) -> list[int]:
    """One bitmask row (int32 words) allowing the tokens in ``allowed``."""
    words = [0] * -(-vocab // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # as int32


class _Script:
    """Runs every kind of step on one runner, in an order that keeps each valid, counting each."""

    def __init__(self, runner: ModelRunner, *, cuda_sync_errors: bool = False, kernel_files: tuple[str, ...] = ()) -> None:
        self.runner = runner
        self.cuda_sync_errors = cuda_sync_errors
        self.kernel_files = kernel_files
        self.results: list[tuple[str, HostSyncCounter, StepOutput]] = []

    def step(self, kind: str, batch: Batch, sampled: list[_Seq]) -> StepOutput:
        with HostSyncCounter(self.runner.device, self.kernel_files) as counter:
            if self.cuda_sync_errors:
                torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
            try:
                out = self.runner.execute(batch)
            finally:
                if self.cuda_sync_errors:
                    torch.cuda.set_sync_debug_mode("default")
        self.results.append((kind, counter, out))
        rows = 0
        for j, seq in enumerate(sampled):  # the kept drafts and the token after them
            kept = 0 if out.num_accepted is None else out.num_accepted[j]
            drafts = 0 if batch.drafts.token_ids is None else len(batch.drafts.token_ids[j])
            del seq.tokens[len(seq.tokens) - drafts + kept:]
            new = out.token_ids[rows + kept]
            seq.tokens.append(new)
            seq.outputs += seq.tokens[len(seq.tokens) - kept - 1:]
            rows += drafts + 1
        return out

    def run(self) -> list[tuple[str, HostSyncCounter, StepOutput]]:
        a, b = _Seq(_prompt(20, 3), [0, 1]), _Seq(_prompt(9, 5), [2, 12])
        self.step("prefill", _batch(0, [(a, 20, True), (b, 9, True)]), [a, b])
        self.step("decode", _batch(1, [(a, 1, True), (b, 1, True)]), [a, b])
        c = _Seq(_prompt(40, 11), [3, 4, 5])
        chunk = _Seq(c.tokens[:24], c.pages)  # the first chunk of c's prompt: nothing sampled
        self.step("mixed", _batch(2, [(a, 1, True), (chunk, 24, False), (b, 1, True)]), [a, b])
        self.step("mixed", _batch(3, [(c, 16, True), (a, 1, True), (b, 1, True)]), [c, a, b])
        for step in (4, 5):
            self.step("sampled", _batch(step, [(a, 1, True), (b, 1, True), (c, 1, True)], SAMPLED), [a, b, c])
        self.step("logprobs", _batch(6, [(a, 1, True), (b, 1, True), (c, 1, True)], LOGPROBS), [a, b, c])
        vocab = self.runner.vocab_size
        masks = TokenMasks(rows=[1], bitmask=torch.tensor([_mask_row(range(40, 90), vocab)], dtype=torch.int32))
        self.step("structured", _batch(7, [(a, 1, True), (b, 1, True)], token_masks=masks), [a, b])
        d = _Seq(_prompt(37, 13), [6, 7, 8])
        out = self.step("kv_export", _batch(8, [(d, 37, True), (c, 1, True)], kv_moves=BatchKVMoves(exports=[(0, d.pages)])), [d, c])
        assert out.kv_exports is not None
        payload = out.kv_exports[0]
        assert isinstance(payload, KVPayload)
        # d again, from its imported prompt in other pages (the prefill's KV, not this runner's own).
        e = _Seq(d.tokens[:37], [9, 10, 11])
        e.tokens.append(d.tokens[37])
        e.outputs.append(d.tokens[37])
        imports: list[tuple[list[int], RankPayloads]] = [(e.pages, (payload,))]
        self.step("kv_import", _batch(9, [(e, 1, True), (c, 1, True)], kv_moves=BatchKVMoves(imports=imports)), [e, c])
        # Three drafts to verify after a's pending token; b beside it has none.
        a.tokens += [a.tokens[-1], 12, 13]
        self.step("spec_verify", _batch(10, [(a, 4, True), (b, 1, True)], [SAMPLED[0], GREEDY],
                                        drafts=[a.tokens[-3:], []]), [a, b])
        return self.results


def _drafting_steps(
    runner: ModelRunner, *, cuda_sync_errors: bool = False
) -> list[tuple[str, HostSyncCounter, StepOutput]]:
    """A prompt that proposes drafts, then a step verifying them that proposes the next ones."""
    script = _Script(runner, cuda_sync_errors=cuda_sync_errors)
    a = _Seq(_prompt(20, 3), [0, 1])
    out = script.step("draft", replace(_batch(0, [(a, 20, True)]), drafts=BatchDrafts(num_propose=[3])), [a])
    assert out.draft_token_ids is not None and len(out.draft_token_ids[0]) == 3
    a.tokens += out.draft_token_ids[0]
    verify = _batch(1, [(a, 4, True)], drafts=[out.draft_token_ids[0]])
    script.step("draft", replace(verify, drafts=replace(verify.drafts, num_propose=[3])), [a])
    return script.results


def _static_decode_steps(
    runner: ModelRunner, *, cuda_sync_errors: bool = False, kernel_files: tuple[str, ...] = ()
) -> list[tuple[str, HostSyncCounter, StepOutput]]:
    """Decode steps of 3 and then 2 sequences on the static buffers (padded to 4 and 2), sampled and greedy."""
    assert runner.graphs is not None
    script = _Script(runner, cuda_sync_errors=cuda_sync_errors, kernel_files=kernel_files)
    a, b, c = _Seq(_prompt(20, 3), [0, 1]), _Seq(_prompt(9, 5), [2, 12]), _Seq(_prompt(17, 9), [3, 4])
    script.step("prefill", _batch(0, [(a, 20, True), (b, 9, True), (c, 17, True)]), [a, b, c])
    replays = runner.graphs.replays
    script.step("static_decode", _batch(1, [(a, 1, True), (b, 1, True), (c, 1, True)], SAMPLED), [a, b, c])
    script.step("static_decode", _batch(2, [(a, 1, True), (c, 1, True)]), [a, c])
    assert runner.graphs.replays == replays + 2
    return script.results


def make_runner(model: Path, device: str, speculative_config: SpeculativeConfig | None = None,
                **overrides: object) -> ModelRunner:  # fmt: skip
    """A runner on ``model`` with torch attention, taking the path a CUDA step takes (no CPU kernel)."""
    before = os.environ.get(cpu_kernels.ENV_SWITCH)
    os.environ[cpu_kernels.ENV_SWITCH] = "0"
    try:
        config = EngineConfig(model=str(model), device=device, max_model_len=128,
                              max_num_seqs=4, max_num_batched_tokens=256, num_kv_pages=16, seed=0,
                              speculative_config=speculative_config,
                              **{"attention_backend": "torch", "dtype": "float32", **overrides})
        return ModelRunner(config)
    finally:
        if before is None:
            del os.environ[cpu_kernels.ENV_SWITCH]
        else:
            os.environ[cpu_kernels.ENV_SWITCH] = before


def count_step_syncs(model: Path, *, device_path: bool) -> list[tuple[str, HostSyncCounter, StepOutput]]:
    """Every kind of step on a fresh CPU runner, each under its own counter.

    ``device_path``: the sampler takes the branches it takes on CUDA, where
    no filter may read a tensor (``sampler._reads_are_free``), instead of
    the CPU's.
    """
    runner = make_runner(model, "cpu")
    with pytest.MonkeyPatch.context() as patch:
        if device_path:
            patch.setattr(sampler_module, "_reads_are_free", lambda device: False)
        return _Script(runner).run()


SELF_DRAFT = SpeculativeConfig(method="draft", num_speculative_tokens=3, layers=1)
KINDS = {"prefill", "decode", "mixed", "sampled", "logprobs", "structured", "kv_export", "kv_import", "spec_verify"}
# The CPU's own branch (a nucleus the sorted head cannot settle gets a full
# sort, the rows found by reading the filter's result): what the sampled rows
# of these kinds read on the CPU besides the step's one read.
CPU_ONLY_READS = {"sampled": ["__bool__"], "spec_verify": ["__bool__", "nonzero"]}


def test_guard_counts_what_would_sync_and_nothing_else() -> None:
    x, cpu, real_to_host = torch.arange(6), torch.device("cpu"), device_copy.to_host
    with HostSyncCounter(cpu) as counter:
        x[0].item()
        x.tolist()
        bool(x[1])
        int(x[2])
        x.nonzero()
        x[x > 2]
        torch.bincount(x)
        torch.repeat_interleave(x, x)
        torch.tensor([1, 2], device=cpu)
        x.to(cpu)
    assert counter.calls == ["item", "tolist", "__bool__", "__int__", "nonzero", "__getitem__(bool index)",
                             "bincount", "repeat_interleave(tensor repeats)", "tensor(device=cpu)", "to(cpu)"]
    with HostSyncCounter(cpu) as counter:
        x.to(cpu, non_blocking=True)
        torch.tensor([1, 2])
        x[torch.tensor([0, 2])]
        torch.repeat_interleave(x, x, output_size=15)
        (host,) = device_copy.to_host([x * 2])
        host.tolist()
    assert counter.calls == [] and counter.allowed == 1
    assert device_copy.to_host is real_to_host  # put back on leaving
    with HostSyncCounter(cpu, kernel_files=(flashinfer_emulator.__file__,)) as counter:
        flashinfer_emulator._ints("indptr", torch.arange(3, dtype=torch.int32))  # the stand-in kernels' own read
        x.tolist()
    assert counter.kernel_calls == ["tolist"] and counter.calls == ["tolist"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_embedded_model("tiny", root=tmp_path_factory.mktemp("cache"))


def test_each_step_waits_once_at_its_end(tiny: Path) -> None:
    on_device = count_step_syncs(tiny, device_path=True)
    assert {kind for kind, _, _ in on_device} == KINDS
    for kind, counter, _ in on_device:
        assert counter.calls == [] and counter.allowed == 1, (kind, counter.calls, counter.allowed)
    # The CPU's branches read only where they say, and sample the same tokens.
    on_cpu = count_step_syncs(tiny, device_path=False)
    for (kind, counter, out), (_, _, device_out) in zip(on_cpu, on_device, strict=True):
        assert counter.calls == CPU_ONLY_READS.get(kind, []) and counter.allowed == 1, (kind, counter.calls)
        assert out.token_ids == device_out.token_ids and out.logprobs == device_out.logprobs, kind
        assert out.num_accepted == device_out.num_accepted
    assert [o.num_accepted for k, _, o in on_cpu if k == "spec_verify"] != [None]


def test_drafting_waits_once_more_for_its_drafts(tiny: Path) -> None:
    """A step that proposes drafts reads its tokens (the drafts start after them), then all its drafts at once."""
    runner = make_runner(tiny, "cpu", speculative_config=SELF_DRAFT)
    for kind, counter, _ in _drafting_steps(runner):
        assert counter.calls == [] and counter.allowed == 2, (kind, counter.calls, counter.allowed)


def test_static_decode_waits_once(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode on the static buffers (``cuda_graphs``) waits only for its sampled tokens.

    FlashInfer's backend runs under the tests' emulator, whose host reads
    are the stand-in kernels' own (``HostSyncCounter.kernel_calls``); the
    sampler takes its CUDA branches, as in ``count_step_syncs``.
    """
    monkeypatch.setattr(sampler_module, "_reads_are_free", lambda device: False)
    runner = make_runner(tiny, "cpu", attention_backend="flashinfer", attention_kernels=flashinfer_emulator,
                         cuda_graphs=True)  # fmt: skip
    results = _static_decode_steps(runner, kernel_files=(flashinfer_emulator.__file__,))
    for kind, counter, _ in results:
        assert counter.calls == [] and counter.allowed == 1, (kind, counter.calls, counter.allowed)
    assert all(counter.kernel_calls for _, counter, _ in results)  # the emulator did read: they were set aside


def test_static_decode_of_a_moe_model_waits_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting the experts' tokens (padding rows weighed 0 on the device) adds no wait to a static decode step."""
    monkeypatch.setattr(sampler_module, "_reads_are_free", lambda device: False)
    model = write_checkpoint(tmp_path / "mixtral", mixtral_config(), seed=1)
    runner = make_runner(model, "cpu", attention_backend="flashinfer", attention_kernels=flashinfer_emulator,
                         cuda_graphs=True)  # fmt: skip
    for kind, counter, _ in _static_decode_steps(runner, kernel_files=(flashinfer_emulator.__file__,)):
        assert counter.calls == [] and counter.allowed == 1, (kind, counter.calls, counter.allowed)
    # 46 prompt tokens, then 3 and 2 decoded (padded to 4 and 2): 51 tokens, top-2, in each of the 2 layers.
    assert [sum(layer) for layer in runner.command(ReadExpertTokens())] == [102, 102]


def test_runner_takes_the_cuda_attention_path(tiny: Path) -> None:
    runner = make_runner(tiny, "cpu")
    assert isinstance(runner.attn, TorchPagedAttention) and not runner.attn.uses_cpu_kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_steps_raise_on_no_sync(tiny: Path) -> None:
    """Every kind of step on CUDA under ``set_sync_debug_mode("error")``: only ``to_host``'s event wait."""
    runner = make_runner(tiny, "cuda")
    results = _Script(runner, cuda_sync_errors=True).run()
    assert {kind for kind, _, _ in results} == KINDS
    for kind, counter, _ in results:
        assert counter.calls == [] and counter.allowed == 1, (kind, counter.calls, counter.allowed)
    drafter = make_runner(tiny, "cuda", speculative_config=SELF_DRAFT)
    for kind, counter, _ in _drafting_steps(drafter, cuda_sync_errors=True):
        assert counter.calls == [] and counter.allowed == 2, (kind, counter.calls, counter.allowed)
    if flashinfer_installed():  # decode as replayed CUDA graphs, in bfloat16 (FlashInfer's dtypes)
        graphs = make_runner(tiny, "cuda", attention_backend="flashinfer", cuda_graphs=True, dtype="bfloat16")
        assert graphs.graphs is not None and graphs.graphs.captured
        for kind, counter, _ in _static_decode_steps(graphs, cuda_sync_errors=True):
            assert counter.calls == [] and counter.allowed == 1, (kind, counter.calls, counter.allowed)


def main() -> None:
    """Print the counts per step kind (every wait, the allowed read included), CPU branches then CUDA's."""
    model = ensure_embedded_model("tiny")
    for device_path in (False, True):
        print("sampler branches:", "CUDA's" if device_path else "the CPU's")
        results = count_step_syncs(model, device_path=device_path)
        results += _drafting_steps(make_runner(model, "cpu", speculative_config=SELF_DRAFT))  # greedy drafts
        static = make_runner(model, "cpu", attention_backend="flashinfer", attention_kernels=flashinfer_emulator,
                             cuda_graphs=True)  # fmt: skip
        with pytest.MonkeyPatch.context() as patch:
            if device_path:
                patch.setattr(sampler_module, "_reads_are_free", lambda device: False)
            results += _static_decode_steps(static, kernel_files=(flashinfer_emulator.__file__,))[1:]
        for kind, counter, _ in results:
            names = ", ".join(counter.calls) or "-"
            print(f"  {kind:12s} waits {counter.count:3d} (allowed reads {counter.allowed}): {names}")


if __name__ == "__main__":
    main()
