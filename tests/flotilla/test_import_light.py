"""``import flotilla`` needs aiohttp alone: no torch, Ray or pydantic (nor jsonschema, which ``parse`` imports on use)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "pydantic", "numpy", "transformers", "jsonschema")


def test_import_pulls_in_no_server_side_package() -> None:
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import flotilla; "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_import_in_a_fresh_venv_with_only_aiohttp(tmp_path: Path) -> None:
    # The venv gets no pip of its own: this venv's pip installs into it (``--python``), which
    # skips ensurepip (most of the time) and leaves aiohttp and its dependencies alone in it.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    install = subprocess.run([*pip, "install", "-q", "aiohttp"], capture_output=True, text=True, timeout=300)
    if install.returncode != 0:
        offline = ("Could not find a version", "No matching distribution", "NewConnectionError",
                   "Temporary failure in name resolution", "Network is unreachable")
        if any(s in install.stderr for s in offline):
            pytest.skip(f"the package index is unreachable: {install.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"pip install aiohttp failed:\n{install.stderr}")
    listed = subprocess.run([*pip, "list", "--format=freeze"], capture_output=True, text=True, check=True,
                            timeout=120).stdout.lower().split()
    names = {line.split("==")[0] for line in listed}
    assert "aiohttp" in names and not names & set(HEAVY), names
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import flotilla; print(flotilla.Client); "
            f"c = flotilla.Client('http://127.0.0.1:1'); c.close()")
    run = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "flotilla.client.Client" in run.stdout
