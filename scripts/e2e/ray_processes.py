"""List the Ray processes this process can see; exit 1 if there are any.

    python scripts/e2e/ray_processes.py

Matches processes the way `ray stop` finds them (Ray's own RAY_PROCESSES
list). `make e2e` runs it inside the node's PID namespace after `ray down`,
where the only processes visible are the e2e's own.
"""

from __future__ import annotations

import subprocess
import sys

from ray.autoscaler._private.constants import RAY_PROCESSES


def ray_processes() -> list[str]:
    """``"pid command line"`` of every visible process that `ray stop` would stop."""
    import psutil  # Ray's bundled copy, on sys.path once ray is imported (as `ray stop` uses it)

    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:  # exited, not yet reaped by its parent
            continue
        name, cmdline = proc.info["name"] or "", proc.info["cmdline"] or []
        args = subprocess.list2cmdline(cmdline)
        for keyword, by_name in RAY_PROCESSES:
            if keyword in (name if by_name else args):
                found.append(f"{proc.info['pid']} {args[:200]}")
                break
    return found


if __name__ == "__main__":
    left = ray_processes()
    for line in left:
        print(f"ray process still running: {line}")
    sys.exit(1 if left else 0)
