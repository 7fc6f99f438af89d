"""Where the CPU goes while ``flotilla bench serve`` loads a server on this host.

``snapshot()`` reads every process's and thread's CPU clock (``utime + stime``
in ``/proc``) and names each process by its role in the serving path: the
Serve proxy, the replica, the scheduler actor, a model shard, the rest of Ray
(controller, raylet, GCS, dashboard, agents), HAProxy (``--ingress haproxy``)
and this benchmark client. Two
snapshots around a run give ``breakdown``: for each role, the CPU seconds, the
cores it kept busy, and its cost per request, per output token and per engine
step, with its busiest threads (Ray's C++ threads carry their own names; the
Python threads carry the process name, and the forward's thread is named
``engine-step`` by the scheduler actor).

Linux only (``/proc``); the server must run on this machine. Processes that
start or end during the run count for the part of it they were alive.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TICKS_PER_S = os.sysconf("SC_CLK_TCK")

# First match wins: (role, substring of the command line).
ROLES: tuple[tuple[str, str], ...] = (
    ("proxy", "ray::ProxyActor"),
    ("haproxy", "haproxy "),
    ("replica", "ray::ServeReplica"),
    ("scheduler_actor", "ray::SchedulerService"),
    ("shard", "ray::ModelShardActor"),
    ("serve_controller", "ray::ServeController"),
    ("raylet", "/raylet/raylet"),
    ("gcs", "gcs_server"),
    ("ray_other", "ray::"),
    ("ray_other", "ray/dashboard"),
    ("ray_other", "ray/autoscaler"),
    ("ray_other", "ray/_private"),
    ("ray_other", "ray.dashboard"),
)
SERVING_ROLES = ("proxy", "haproxy", "replica", "scheduler_actor", "shard")


@dataclass(frozen=True, slots=True)
class ProcessCpu:
    """One process's CPU clock (ticks) and its threads', keyed by thread id."""

    role: str
    ticks: int
    threads: dict[int, tuple[str, int]] = field(default_factory=dict)  # tid -> (name, ticks)


def role_of(cmdline: str, pid: int, client_pid: int) -> str | None:
    """The role a process plays, or None when it is not part of the run."""
    if pid == client_pid:
        return "client"
    for role, needle in ROLES:
        if needle in cmdline:
            return role
    return None


def _ticks(stat_path: Path) -> tuple[str, int] | None:
    try:
        text = stat_path.read_text()
    except OSError:  # the process or thread ended between listing and reading
        return None
    name = text[text.index("(") + 1: text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return name, int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


def snapshot(proc: Path = Path("/proc"), client_pid: int | None = None) -> dict[int, ProcessCpu]:
    """Every process of the serving path with its CPU clock and its threads'."""
    me = os.getpid() if client_pid is None else client_pid
    out: dict[int, ProcessCpu] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        role = role_of(cmdline, pid, me)
        total = _ticks(entry / "stat") if role else None
        if role is None or total is None:
            continue
        threads: dict[int, tuple[str, int]] = {}
        for task in (entry / "task").iterdir() if (entry / "task").is_dir() else ():
            t = _ticks(task / "stat")
            if t is not None and task.name.isdigit():
                threads[int(task.name)] = t
        out[pid] = ProcessCpu(role, total[1], threads)
    return out


def _per(value_s: float, count: int, scale: float) -> float | None:
    return round(value_s * scale / count, 3) if count > 0 else None


def breakdown(before: dict[int, ProcessCpu], after: dict[int, ProcessCpu], *, wall_s: float,
              num_requests: int, output_tokens: int, engine_steps: int | None,
              top_threads: int = 4) -> dict[str, Any]:
    """CPU by role between two snapshots, normalised by the run's work."""
    roles: dict[str, dict[str, Any]] = {}
    for pid, end in after.items():
        start = before.get(pid)
        used = end.ticks - (start.ticks if start else 0)
        r = roles.setdefault(end.role, {"cpu_s": 0.0, "processes": 0, "_threads": {}})
        r["cpu_s"] += used / TICKS_PER_S
        r["processes"] += 1
        main = _main_name(end)
        for tid, (name, ticks) in end.threads.items():
            was = start.threads.get(tid, (name, 0))[1] if start else 0
            label = "python" if name == main else name
            r["_threads"][label] = r["_threads"].get(label, 0.0) + (ticks - was) / TICKS_PER_S
    steps = engine_steps or 0
    report: dict[str, Any] = {}
    for role in sorted(roles, key=lambda k: -roles[k]["cpu_s"]):
        r = roles[role]
        cpu_s = r["cpu_s"]
        threads = sorted(r["_threads"].items(), key=lambda kv: -kv[1])[:top_threads]
        report[role] = {
            "cpu_s": round(cpu_s, 3),
            "cores": round(cpu_s / wall_s, 3) if wall_s > 0 else None,
            "processes": r["processes"],
            "ms_per_request": _per(cpu_s, num_requests, 1e3),
            "us_per_output_token": _per(cpu_s, output_tokens, 1e6),
            "us_per_step": _per(cpu_s, steps, 1e6),
            "top_threads_s": {name: round(s, 3) for name, s in threads if s > 0},
        }
    serving = sum(report[r]["cpu_s"] for r in SERVING_ROLES if r in report)
    return {
        "wall_s": round(wall_s, 3),
        "num_requests": num_requests,
        "output_tokens": output_tokens,
        "engine_steps": engine_steps,
        "tokens_per_step": round(output_tokens / steps, 2) if steps else None,
        "serving_path_us_per_output_token": _per(serving, output_tokens, 1e6),
        "by_role": report,
    }


def _main_name(p: ProcessCpu) -> str:
    """The thread name the process's own threads inherit (its ``comm``): the Python threads."""
    names = [name for _, (name, _) in sorted(p.threads.items())]
    return names[0] if names else ""
