"""Compile ``StructuredOutput`` constraints into xgrammar grammars: once per distinct value, off the step.

Compiling runs on one worker thread (xgrammar releases the GIL while it
compiles, so engine steps go on meanwhile). Results are cached by the
constraint's ``key``, failures too, so a repeated bad schema costs nothing
and concurrent requests with one new schema compile it once.

Every wait is bounded by ``timeout_s``: a constraint still compiling then is
refused with ``InvalidParameterError`` naming the request field, and the
replica goes on serving. The compile itself cannot be interrupted; it runs to
its end on the worker and a later request with the same constraint gets its
result. One worker means a pathological constraint delays other new ones
(they time out too), never a step.

JSON is compiled compact (no optional whitespace): a small model given the
freedom of "any whitespace" can emit newlines until ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import xgrammar as xgr

from actors.grammar.closing import ClosingPath
from scheduling.errors import InvalidParameterError
from scheduling.structured_output import StructuredOutput

DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_MAX_CACHED = 256
RECENT_COMPILES = 256  # compile durations kept for the metrics histogram (see ``compile_seconds``)
_JSON_SEPARATORS = (", ", ": ")  # as json.dumps writes it: what models have read most


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe.

    ``vocab_size`` is the model's logits width (it may exceed the
    tokenizer's); ``eos_token_id`` is the token that ends a complete output.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_id: int | None, *,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, max_cached: int = DEFAULT_MAX_CACHED,
    ) -> None:
        if timeout_s <= 0:
            raise InvalidParameterError("grammar_compile_timeout_s", f"must be > 0, got {timeout_s}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.timeout_s = timeout_s
        self.max_cached = max_cached
        self._compiler: xgr.GrammarCompiler | None = None  # built on the worker by the first compile
        self._closing: ClosingPath | None = None
        self._info: xgr.TokenizerInfo | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self.num_compiles = 0  # finished compiles, ok or not
        self._recent: list[float] = []  # their durations (seconds), the last RECENT_COMPILES

    # ------------------------------------------------------------- compiling
    def submit(self, spec: StructuredOutput) -> Future[xgr.CompiledGrammar]:
        """The compile of ``spec``: cached, or started now on the worker."""
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None:
                self._cache.move_to_end(spec.key)
                return fut
            fut = self._pool.submit(self._compile, spec.kind, spec.spec)
            self._cache[spec.key] = fut
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return fut

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """Wait (at most ``timeout_s``) for ``spec``'s grammar; errors name ``spec.param``."""
        fut = self.submit(spec)
        try:
            fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise self._too_slow(spec) from None
        except Exception:
            pass  # raised below with the request field named
        return self._result(spec, fut)

    async def compile_async(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """``compile`` for an event loop: waits without blocking it."""
        fut = self.submit(spec)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout_s)
        except TimeoutError:
            raise self._too_slow(spec) from None
        except Exception:
            pass  # raised below with the request field named
        return self._result(spec, fut)

    def _too_slow(self, spec: StructuredOutput) -> InvalidParameterError:
        return InvalidParameterError(
            spec.param, f"the {spec.kind} constraint did not compile within {self.timeout_s:g} s; simplify it",
        )

    @staticmethod
    def _result(spec: StructuredOutput, fut: Future[xgr.CompiledGrammar]) -> xgr.CompiledGrammar:
        exc = fut.exception()
        if exc is not None:
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            # xgrammar prefixes "[time] file.cc:line: "; the reason follows the last ": " of that prefix.
            if ".cc:" in message:
                message = message.split(".cc:", 1)[1].split(": ", 1)[-1]
            raise InvalidParameterError(spec.param, f"the {spec.kind} constraint does not compile: {message}")
        return fut.result()

    def _compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        try:
            return self._builder(kind)(spec)
        finally:
            with self._lock:
                self.num_compiles += 1
                self._recent.append(time.perf_counter() - start)
                del self._recent[:-RECENT_COMPILES]

    def _builder(self, kind: str) -> Callable[[str], xgr.CompiledGrammar]:
        compiler = self._xgr()
        if kind == "json":
            return lambda s: compiler.compile_grammar(json_schema_grammar(s))
        if kind == "json_object":
            return lambda _: compiler.compile_grammar(json_schema_grammar('{"type": "object"}'))
        if kind == "regex":
            return lambda s: compiler.compile_grammar(regex_grammar(s))
        if kind == "choice":
            return lambda s: compiler.compile_grammar(_choice_grammar(json.loads(s)))
        assert kind == "grammar", kind
        return compiler.compile_grammar

    def _xgr(self) -> xgr.GrammarCompiler:
        """The xgrammar compiler, built on first use (it reads the whole vocabulary: only grammars pay for it)."""
        if self._compiler is None:
            stop = [] if self.eos_token_id is None else [self.eos_token_id]
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop or None,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            self._info = info
        return self._compiler

    def closing_path(self) -> ClosingPath:
        """Shortest-completion walks over this vocabulary (after a compile: it reads the same vocabulary)."""
        if self._closing is None:
            assert self.eos_token_id is not None, "constrained requests need an end-of-sequence token"
            self._xgr()
            assert self._info is not None
            self._closing = ClosingPath(self._info, self.eos_token_id)
        return self._closing

    # ---------------------------------------------------------------- metrics
    def compile_seconds(self) -> tuple[int, tuple[float, ...]]:
        """Compiles finished so far and the durations of the last ``RECENT_COMPILES`` of them."""
        with self._lock:
            return self.num_compiles, tuple(self._recent)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# xgrammar (0.2.9) lets two kinds of text through that are not valid JSON strings, both fixed in the
# grammar's text before it compiles: length-bounded strings ("maxLength") take raw control
# characters (json.loads refuses them), and negated classes and "." take UTF-16 surrogates, which
# are not characters (their UTF-8 bytes decode to three U+FFFD, so maxLength no longer holds).
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
# A string literal (kept as it is), a negated class, or xgrammar's "any character" class.
_LITERAL_OR_CLASS = re.compile(r'("(?:\\.|[^"\\])*")|\[\^((?:\\.|[^\]\\])*)\]|(\[\\0-\\U0010ffff\])')
_NO_SURROGATES = r"\uD800-\uDFFF"


def json_schema_grammar(schema: str) -> str:
    """The EBNF of a JSON schema (compact, one space after ``,`` and ``:``), strings valid JSON."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=_JSON_SEPARATORS)
    return without_surrogates(str(grammar).replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def regex_grammar(pattern: str) -> str:
    """The EBNF of a regex whose "." and negated classes match characters only."""
    return without_surrogates(str(xgr.Grammar.from_regex(pattern)))


def without_surrogates(ebnf: str) -> str:
    """``ebnf`` (as xgrammar prints it) with surrogate code points out of every negated class and "."."""
    def fix(m: re.Match[str]) -> str:
        if m.group(1) is not None:
            return m.group(1)
        return f"[^{m.group(2) or ''}{_NO_SURROGATES}]"

    return _LITERAL_OR_CLASS.sub(fix, ebnf)


def _choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of ``choices``: string literals escape as JSON strings do."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
