"""``bench accuracy``'s teacher-forced figures: the KL and top-1 agreement along the base output, and perplexity.

Everything here runs the engine's own ``ModelRunner`` (its model, its paged
attention over its own KV pool) on forced tokens; ``run`` drives it.

Why one prefill per sequence measures a quantized KV cache. The attention
backend writes a step's K/V into the pool *before* it attends, and the
prefill path (``TorchPagedAttention._attend``) gathers every key and value it
attends to, the step's own included, back from the pool pages, dequantizing
int8 / fp8 rows with their scales. So every position of a teacher-forced
prefill attends over quantized K/V, exactly as a generated token does. The
scale is per token and kv head (``kv_quant``), so the bytes a position
stores do not depend on how the sequence was split into steps: a prefill of
the whole sequence stores what token-by-token decoding stores, and chunked
prefill or decode-step forcing would read the same bytes (decode steps go
through the native ``paged_decode`` kernel, which applies the scales inside
its dot products: the same values, summed in another order).
``tests/cli/bench/test_bench_accuracy_tokens.py`` checks that an int8 KV candidate's
teacher-forced figures move off the base's (a prefill that attended over its
in-step float K/V would leave them equal).

Figures:

- ``token_top1_agreement``: over every position of every base reply, the
  share where the candidate's teacher-forced argmax equals the base's own
  teacher-forced argmax (both sides through the same prefill path, so a
  config against itself scores exactly 1).
- ``perplexity_ratio``: perplexity of the candidate over the base's on a fixed
  held-out text (``data/heldout_prose.txt``, see ``data/README.md``),
  cut into non-overlapping windows of ``HELDOUT_WINDOW`` tokens (fewer when
  ``max_model_len`` is smaller); each window is its own sequence from position
  0 and every token but its first is scored. The ratio is
  ``exp(mean NLL(candidate) - mean NLL(base))`` over the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from actors.runner.model_runner import ModelRunner
from cli.bench.workload import DATA_DIR
from kvcache.attention.backend import StepLayout
from scheduling.errors import InvalidParameterError

HELDOUT_PATH = DATA_DIR / "heldout_prose.txt"
# Long enough that most scored tokens have hundreds of tokens of context; one
# window's logits (window x vocab float32) stay a few hundred MB for SmolLM2.
HELDOUT_WINDOW = 1024


@torch.inference_mode()
def teacher_forced_logits(runner: ModelRunner, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Float32 logits (len(output), vocab) on the CPU: row i is the distribution that predicts output[i].

    One prefill of ``prompt + output[:-1]`` (the last output token predicts
    nothing we compare) into pool pages 0.. of ``runner``. It overwrites
    whatever those pages held, so the caller runs it only on an engine with
    no live request and never generates on that engine again (the prefix
    cache may index these pages): ``run._teacher_forced`` checks the
    first, ``run.run`` shuts the engine down right after.
    """
    assert output, "every greedy request emits at least one token (max_tokens >= 1)"
    tokens = prompt + output[:-1]
    num_pages = -(-len(tokens) // runner.config.page_size)
    assert num_pages <= runner.capacity.num_pages, (num_pages, runner.capacity.num_pages)
    dev = runner.device
    runner.attn.plan(StepLayout([len(tokens)], [len(tokens)], [list(range(num_pages))]))
    hidden = runner.model(torch.tensor(tokens, dtype=torch.long, device=dev),
                          torch.arange(len(tokens), dtype=torch.long, device=dev), runner.attn)
    return runner.model.compute_logits(hidden[len(prompt) - 1:]).cpu()


def _same_shape(base_logits: torch.Tensor, against_logits: torch.Tensor) -> None:
    if base_logits.shape != against_logits.shape:
        raise InvalidParameterError(
            "against", f"logits of shape {tuple(against_logits.shape)}, the base's are {tuple(base_logits.shape)} "
            "(a model with another vocabulary cannot be compared)")


def kl_per_position(base_logits: torch.Tensor, against_logits: torch.Tensor) -> torch.Tensor:
    """KL(base || against) of each row's softmax, in float64: shape (rows,)."""
    _same_shape(base_logits, against_logits)
    lp = torch.log_softmax(base_logits.double(), dim=-1)
    lq = torch.log_softmax(against_logits.double(), dim=-1)
    p = lp.exp()
    # Rows where base gives a token zero probability contribute 0 (0 * log 0 / q), not NaN.
    return torch.where(p > 0, p * (lp - lq), torch.zeros_like(p)).sum(dim=-1)


def top1_matches(base_logits: torch.Tensor, against_logits: torch.Tensor) -> torch.Tensor:
    """Per row, whether both argmaxes are the same token: bool (rows,)."""
    _same_shape(base_logits, against_logits)
    return base_logits.argmax(dim=-1) == against_logits.argmax(dim=-1)


def token_nll(logits: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """-log p(targets[i]) under row i's softmax, in float64: shape (rows,)."""
    assert logits.shape[0] == len(targets), (logits.shape, len(targets))
    picked = torch.tensor(targets, dtype=torch.long).unsqueeze(-1)
    return -torch.log_softmax(logits.double(), dim=-1).gather(-1, picked).squeeze(-1)


def read_heldout(path: str | Path) -> str:
    """The held-out text at ``path``; a missing or blank file is an error naming ``heldout``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidParameterError("heldout", f"cannot read {path}: {e}") from e
    if not text.strip():
        raise InvalidParameterError("heldout", f"{path} holds no text")
    return text


def heldout_windows(tokenizer: PreTrainedTokenizerBase, text: str, size: int) -> list[list[int]]:
    """``text``'s ids (no special tokens) cut into windows of ``size``; a last window of one token is dropped."""
    if size < 2:
        raise InvalidParameterError("max_model_len", f"leaves a held-out window of {size} tokens (2 at least)")
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    windows = [ids[i:i + size] for i in range(0, len(ids), size)]
    return [w for w in windows if len(w) >= 2]


@dataclass(frozen=True, slots=True)
class HeldoutScore:
    """One engine on the held-out windows: per scored token, its NLL and the engine's argmax there."""

    nll: torch.Tensor  # float64 (tokens,)
    argmax: torch.Tensor  # int64 (tokens,)

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.nll.mean()))


def score_heldout(runner: ModelRunner, windows: list[list[int]]) -> HeldoutScore:
    """Teacher-forced NLL and argmax of every window token but the first (module docstring)."""
    nll, argmax = [], []
    for w in windows:
        logits = teacher_forced_logits(runner, w[:1], w[1:])
        nll.append(token_nll(logits, w[1:]))
        argmax.append(logits.argmax(dim=-1))
    return HeldoutScore(torch.cat(nll), torch.cat(argmax))


def perplexity_ratio(base: HeldoutScore, against: HeldoutScore) -> float:
    """Perplexity of ``against`` over ``base``'s, on the same tokens."""
    assert base.nll.shape == against.nll.shape, (base.nll.shape, against.nll.shape)
    return math.exp(float(against.nll.mean() - base.nll.mean()))
