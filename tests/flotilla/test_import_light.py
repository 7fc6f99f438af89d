"""``import flotilla`` needs aiohttp alone: no torch, Ray or pydantic (nor jsonschema, which ``parse`` imports on use)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.metadata import Distribution, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "pydantic", "numpy", "transformers", "jsonschema")


def test_import_pulls_in_no_server_side_package() -> None:
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import flotilla; "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def installed_closure(name: str) -> list[Distribution]:
    """``name``'s installed distribution and, recursively, those its requirements name for this interpreter."""
    found: dict[str, Distribution] = {}
    todo = [name]
    while todo:
        dist = distribution(todo.pop())
        key = canonicalize_name(dist.metadata["Name"])
        if key in found:
            continue
        found[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def test_import_in_a_fresh_venv_with_only_aiohttp(tmp_path: Path) -> None:
    """A venv holding aiohttp and its dependencies alone (copied from this one: no package index needed)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    for dist in installed_closure("aiohttp"):
        for file in dist.files or []:
            if file.parts[0] == "..":  # console scripts and data outside site-packages: not needed to import
                continue
            target = site / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(dist.locate_file(file), target)
    listed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "list", "--format=freeze"],
                            capture_output=True, text=True, check=True, timeout=120).stdout.lower().split()
    names = {line.split("==")[0] for line in listed}
    assert "aiohttp" in names and not names & set(HEAVY), names
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import flotilla; print(flotilla.Client); "
            f"c = flotilla.Client('http://127.0.0.1:1'); c.close()")
    run = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "flotilla.client.Client" in run.stdout
