"""The engine: one replica's step loop (``LLMEngine``), its config, outputs and stats, the executor seam, and P/D's engine side.

A step is ``schedule`` (``scheduling``) -> ``execute`` (an ``Executor``:
in-process here, on Ray shards in ``actors.remote``) -> ``finish_step``
(detokenize, stop rules, deltas).
"""
