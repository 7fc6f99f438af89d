"""Why a sequence ended: the one definition of the engine's finish reasons.

Defined here, where the reasons arise (``StopRule`` decides "stop" and
"length", ``BatchPolicy.abort`` "abort"), and re-exported by ``actors.api``
(the engine adds "error"), the type the replica and the fleet read them as.

A ``str`` enum: a member equals its value (``FinishReason.STOP == "stop"``)
and ``json.dumps`` writes the value, so the wire format stays the plain
string. ``str()`` and f-strings give the value too (``__str__``): Python
3.11 would otherwise print ``FinishReason.STOP`` for a ``(str, Enum)``.
"""

from __future__ import annotations

from enum import Enum


class FinishReason(str, Enum):
    STOP = "stop"  # a stop token or stop string; an embedding request's vector is ready
    LENGTH = "length"  # max_tokens generated (or an output constraint closed by its budget)
    ABORT = "abort"  # the caller cancelled it, or its consumer went silent
    ERROR = "error"  # the engine failed it (a shard died, a LoRA load failed, ...): the delta's error says why

    def __str__(self) -> str:
        return self.value

    @property
    def completed(self) -> bool:
        """Ended normally ("stop" or "length"): its output is whole, its latency a healthy request's."""
        return self is FinishReason.STOP or self is FinishReason.LENGTH

    @property
    def failed(self) -> bool:
        """Ended early ("abort" or "error"): its output is cut short."""
        return not self.completed
