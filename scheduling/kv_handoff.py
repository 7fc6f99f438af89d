"""The scheduler's side of prefill/decode disaggregation: which pages leave with a step, which arrive.

A prefill-only request (``Request.kv_moves.export``) computes its prompt and samples
its first token; the step that samples it also copies its prompt pages out
(``Batch.kv_moves.exports``). A request whose prompt was computed elsewhere
(``Request.kv_moves.imported``) is admitted with fresh pages for its prompt and that
first token, the payload written into them before the step's forward
(``Batch.kv_moves.imports``): its one input is the first token, so it decodes at once.

Its prompt counts as computed from the step that admits it (the batch is
planned from ``num_computed_tokens``), but its KV is written only when that
step runs: until the step is settled (``imports_written``) the request keeps
``kv_moves.imported``, and a request released meanwhile (its step failed, or it was
aborted) puts nothing into the prefix cache (``drop_unwritten``), which would
otherwise hand never-written pages to every later request with that prefix.
"""

from __future__ import annotations

from kvcache.kv_transfer import RankPayloads
from scheduling.batch_builder import Scheduled
from scheduling.request import Request
from scheduling.request_pages import RequestPages


def kv_exports(scheduled: list[Scheduled], kv: RequestPages) -> list[tuple[int, list[int]]]:
    """(index among the step's sampled sequences, prompt pages) of each prefill-only request sampling now."""
    exports: list[tuple[int, list[int]]] = []
    j = 0
    for entry in scheduled:
        if entry.samples:
            req = entry.request
            if req.kv_moves.export:
                exports.append((j, req.pages[: kv.pages_for(req.num_prompt_tokens)]))
            j += 1
    return exports


def take_imported(kv: RequestPages, req: Request, imports: list[tuple[list[int], RankPayloads]]) -> bool:
    """Give ``req`` fresh pages for its prompt and first token and queue its payload; False if they do not fit.

    No prefix match: the pages are filled from the payload (they join the
    prefix cache when the request ends, like any computed pages, once the
    step has written them: see the module docstring).
    """
    payload = req.kv_moves.imported
    assert payload is not None and not req.pages and req.num_computed_tokens == 0
    if not kv.may_fit(kv.pages_for(req.num_tokens)) or not kv.reserve(req, req.num_tokens):
        return False
    req.num_computed_tokens = req.num_tokens - 1
    imports.append((req.pages[: kv.pages_for(req.num_prompt_tokens)], payload))
    return True


def imports_written(scheduled: list[Scheduled]) -> None:
    """The step that imported these requests' KV (prefilled, or from the KV tiers) ran: their pages hold it now."""
    for entry in scheduled:
        entry.request.kv_moves.imported = None
        entry.request.kv_moves.tier_unwritten = False


def drop_unwritten(req: Request) -> None:
    """Before ``req`` is released: if its imported KV was never written, none of its pages is computed."""
    if req.kv_moves.imported is not None or req.kv_moves.tier_unwritten:
        req.num_computed_tokens = 0
        req.kv_moves.tier_unwritten = False
