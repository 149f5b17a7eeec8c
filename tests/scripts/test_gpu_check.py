"""scripts/gpu_check.sh --dry-run on CPU: the commands it would run name test paths that exist
and benchmark flags the scripts accept, and its summary line is one JSON object with every key
a real run reports. (The real run needs a CUDA GPU; this keeps the script from rotting.)"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = {"cuda_e2e", "triton_cuda", "hf_parity", "compile_check"}
BENCHES = {f"{m}_{mode}" for m in ("llama-1b", "llama-8b", "smollm2_b1", "moe")
           for mode in ("graphs", "eager")} | {"structured"} | {
    f"overlap_{b}_{mode}" for b in ("b1", "b256") for mode in ("on", "off")}


def test_dry_run_lists_valid_commands_and_the_summary_keys(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary) == {"device", "torch", "triton"} | TESTS | BENCHES
    assert all(summary[k] == "dry-run" for k in TESTS)
    assert all(summary[k] is None for k in BENCHES)

    commands = [shlex.split(line[2:]) for line in proc.stderr.splitlines()
                if line.startswith("+ ")]
    commands = [c[1:] if c[0].startswith("TRITON_INTERPRET=") else c for c in commands]
    assert len(commands) == len(TESTS) + len(BENCHES)
    flags_by_script: dict[str, set[str]] = {}
    for cmd in commands:
        assert cmd[0] == "timeout" and cmd[2] == "python", cmd
        if cmd[3:5] == ["-m", "pytest"]:
            paths = [a for a in cmd[5:] if not a.startswith("-")]
            assert paths and all((ROOT / p).exists() for p in paths), cmd
        else:
            script = cmd[3]
            assert (ROOT / script).is_file(), cmd
            flags_by_script.setdefault(script, set()).update(
                a for a in cmd[4:] if a.startswith("--"))
    assert set(flags_by_script) == {"scripts/bench_throughput.py", "scripts/bench_latency.py",
                                    "scripts/bench_structured.py"}
    for script, flags in flags_by_script.items():
        helped = subprocess.run([sys.executable, script, "--help"], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        assert helped.returncode == 0, helped.stderr[-2000:]
        known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", helped.stdout))
        assert flags <= known, (script, flags - known)


def test_unknown_argument_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--bogus"],
                          env=dict(os.environ, OUT=str(tmp_path)), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr
