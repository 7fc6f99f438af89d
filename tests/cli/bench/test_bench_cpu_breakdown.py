"""``cli.bench.serve.cpu_breakdown``: roles from command lines, CPU from /proc clocks, costs per unit of work."""

from __future__ import annotations

import os
from pathlib import Path

from cli.bench.serve.cpu_breakdown import TICKS_PER_S, breakdown, role_of, snapshot


def _proc(root: Path, pid: int, cmdline: str, threads: dict[int, tuple[str, int]]) -> None:
    d = root / str(pid)
    (d / "task").mkdir(parents=True)
    (d / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode() + b"\0")
    total = sum(t for _, t in threads.values())
    (d / "stat").write_text(f"{pid} ({threads[pid][0]}) S " + " ".join(["0"] * 10) + f" {total} 0 0 0\n")
    for tid, (name, ticks) in threads.items():
        (d / "task" / str(tid)).mkdir()
        # utime holds the ticks, stime 0: fields 14 and 15 of /proc/<pid>/task/<tid>/stat
        (d / "task" / str(tid) / "stat").write_text(f"{tid} ({name}) S " + " ".join(["0"] * 10) + f" {ticks} 0 0\n")


def test_roles_come_from_the_command_line() -> None:
    assert role_of("ray::ProxyActor", 10, 1) == "proxy"
    assert role_of("ray::ServeReplica:flotilla:LLMServer", 10, 1) == "replica"
    assert role_of("ray::SchedulerService.next_outputs", 10, 1) == "scheduler_actor"
    assert role_of("/usr/sbin/haproxy -db -f /tmp/haproxy-serve/x/haproxy.cfg", 10, 1) == "haproxy"
    assert role_of("/venv/lib/ray/core/src/ray/raylet/raylet --x", 10, 1) == "raylet"
    assert role_of("python bench.py", 1, 1) == "client"
    assert role_of("sshd: root", 10, 1) is None


def test_cpu_is_split_by_role_and_thread_and_normalised(tmp_path: Path) -> None:
    before, after = tmp_path / "before", tmp_path / "after"
    _proc(before, 100, "ray::SchedulerService", {100: ("ray::SchedulerS", 10), 101: ("engine-step", 50)})
    _proc(before, 200, "ray::ServeReplica:app:LLMServer", {200: ("ray::ServeRepli", 5), 201: ("worker.io", 5)})
    _proc(after, 100, "ray::SchedulerService", {100: ("ray::SchedulerS", 10 + TICKS_PER_S),
                                                 101: ("engine-step", 50 + 3 * TICKS_PER_S)})
    _proc(after, 200, "ray::ServeReplica:app:LLMServer", {200: ("ray::ServeRepli", 5 + TICKS_PER_S),
                                                          201: ("worker.io", 5)})
    _proc(after, 300, "sshd: root", {300: ("sshd", 99)})  # not part of the run
    a, b = snapshot(before, client_pid=os.getpid()), snapshot(after, client_pid=os.getpid())
    assert set(b) == {100, 200}
    report = breakdown(a, b, wall_s=2.0, num_requests=4, output_tokens=400, engine_steps=100)
    sched, replica = report["by_role"]["scheduler_actor"], report["by_role"]["replica"]
    assert sched["cpu_s"] == 4.0 and sched["cores"] == 2.0
    assert sched["top_threads_s"] == {"engine-step": 3.0, "python": 1.0}
    assert sched["ms_per_request"] == 1000.0 and sched["us_per_output_token"] == 10000.0
    assert sched["us_per_step"] == 40000.0
    assert replica["cpu_s"] == 1.0 and replica["top_threads_s"] == {"python": 1.0}
    assert report["serving_path_us_per_output_token"] == 12500.0
    assert report["tokens_per_step"] == 4.0
    assert list(report["by_role"]) == ["scheduler_actor", "replica"]  # busiest first
