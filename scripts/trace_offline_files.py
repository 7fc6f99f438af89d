"""The repo files one offline ``generate`` runs, in the order their code first runs.

    .venv/bin/python scripts/trace_offline_files.py [--model tiny]

Builds ``LLM(model)``, warms it with one request, then records (through
``sys.setprofile`` on every thread) each repo file whose code is called
while one greedy ``generate`` of one prompt runs. docs/architecture.md lists
the output as the path of an offline request.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a file from anywhere: the repo's packages first

from apps.llm import LLM  # noqa: E402  (after the path set-up above)
from scheduling.sampling_params import SamplingParams  # noqa: E402


class FileOrder:
    """A profile hook that keeps each repo file the first time code in it is called."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self._prefix = f"{ROOT}/"

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(self._prefix) and "/.venv/" not in name:
            rel = name[len(self._prefix):]
            if rel not in self.files:
                self.files.append(rel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    llm = LLM(model=args.model)
    try:
        greedy = SamplingParams(max_tokens=8, temperature=0)
        llm.generate(["a warm-up prompt"], greedy, use_tqdm=False)
        order = FileOrder()
        threading.setprofile(order)
        sys.setprofile(order)
        try:
            llm.generate(["Hello there, how are you?"], greedy, use_tqdm=False)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    finally:
        llm.shutdown()
    print("\n".join(order.files))


if __name__ == "__main__":
    main()
