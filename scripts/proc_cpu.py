"""CPU time per process of a process tree, read from /proc (Linux only).

A benchmark snapshots a server's tree before and after a run and divides each process's
utime + stime (its reaped children's cutime + cstime included) by the tokens the run produced:
CPU seconds per 1,000 output tokens for the frontend, the engine core and each rank, and the
same for another server's processes. Processes are named from their cmdline (vLLM's process
titles as they are; `python -m MODULE`, with RANK for a rank), so two servers' tables line up.
"""

from __future__ import annotations

import os
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    return kids


def process_tree(root: int) -> list[int]:
    kids = _children_map()
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def cpu_seconds(pid: int) -> float | None:
    """utime + stime + cutime + cstime of `pid` (all its threads; its reaped children)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    # fields[0] is field 3 (state): utime, stime, cutime, cstime are fields 14..17
    return sum(int(x) for x in fields[11:15]) / CLK_TCK


def process_name(pid: int) -> str:
    """A stable label: vLLM's process titles (VLLM::EngineCore, VLLM::Worker_TP0, ...) as
    they are; `python -m MODULE` (Tandem's engine core and ranks, with RANK); else the program
    and its first word of interest."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return f"pid {pid}"
    if not argv:
        return f"pid {pid}"
    if len(argv) == 1 and " " in argv[0]:  # setproctitle rewrites argv as one string
        argv = argv[0].split()
    rank = _env(pid, "RANK")
    if "-m" in argv[:-1]:
        mod = argv[argv.index("-m") + 1]
        rest = [a for a in argv[argv.index("-m") + 2:] if not a.startswith("-")][:1]
        label = " ".join([mod, *rest])
        if mod == "workers" and rank is not None:
            return f"workers rank {rank}"
        return label
    prog = os.path.basename(argv[0])
    if prog.startswith("VLLM::") or prog.startswith("vllm::"):
        return prog
    if prog.startswith("python"):
        if "-c" in argv[1:-1]:
            code = argv[argv.index("-c") + 1]
            if "resource_tracker" in code:
                return "multiprocessing resource_tracker"
            return "python -c " + code[:40].replace("\n", " ")
        if len(argv) > 1:
            script = os.path.basename(argv[1])
            sub = [a for a in argv[2:] if not a.startswith("-")][:1]
            return " ".join([script, *sub])
    sub = [a for a in argv[1:] if not a.startswith("-")][:1]
    return " ".join([prog, *sub])


def _env(pid: int, key: str) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                k, _, v = item.partition(b"=")
                if k.decode(errors="replace") == key:
                    return v.decode(errors="replace")
    except OSError:
        pass
    return None


def snapshot(root: int) -> dict[int, tuple[str, float, str]]:
    out = {}
    for pid in process_tree(root):
        secs = cpu_seconds(pid)
        if secs is None:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = ""
        out[pid] = (process_name(pid), secs, cmd[:240])
    return out


def thread_info(pid: int) -> dict[str, Any]:
    """Threads and the CPUs the process may run on (vLLM's CPU workers bind theirs)."""
    info: dict[str, Any] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key == "Threads":
                    info["threads"] = int(val)
                elif key == "Cpus_allowed_list":
                    info["cpus_allowed"] = val.strip()
    except OSError:
        pass
    return info


def cpu_per_process(before: dict, after: dict, out_tokens: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for pid, (name, secs, cmd) in sorted(after.items()):
        used = secs - before.get(pid, (name, 0.0, cmd))[1]
        seen[name] = seen.get(name, 0) + 1
        label = name if seen[name] == 1 else f"{name} #{seen[name]}"
        rows.append({
            "process": label, "pid": pid, "cmdline": cmd, "cpu_s": round(used, 3),
            "cpu_s_per_1k_out": round(1000 * used / out_tokens, 4) if out_tokens else None,
            **thread_info(pid),
        })
    return rows


def gone_during(before: dict, after: dict) -> list[int]:
    """Processes of `before` that exited before `after` was taken: their CPU time is lost."""
    return sorted(set(before) - set(after))
