"""scripts/bench_serve_vs_vllm.py without vLLM: the process-tree accounting and teardown
(a child that left the server's process group is still found and killed, the port is freed),
the medians, and the skip when no vllm is installed."""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import bench_serve_vs_vllm as vs  # noqa: E402
import proc_cpu  # noqa: E402
import server_process  # noqa: E402

# A stand-in server: answers GET /v1/models and has a child in its own session, like Tandem's
# engine processes (start_new_session) that a kill of the leader's group does not reach.
FAKE_SERVER = textwrap.dedent("""
    import http.server, subprocess, sys
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                     start_new_session=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_server_tree_accounting_and_teardown(tmp_path) -> None:
    port = _free_port()
    server = server_process.Server("fake", [sys.executable, "-c", FAKE_SERVER, str(port)], port,
                       dict(os.environ), str(tmp_path / "fake.log"))
    try:
        server.start(timeout_s=30)
        assert server.proc is not None
        deadline = time.monotonic() + 10
        while len(proc_cpu.process_tree(server.proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        snap = proc_cpu.snapshot(server.proc.pid)
        assert len(snap) == 2
        names = [name for name, _, _ in snap.values()]
        assert "python -c import time; time.sleep(120)" in names
        rows = proc_cpu.cpu_per_process({}, snap, out_tokens=1000)
        assert all(r["cpu_s"] >= 0 and r["cpu_s_per_1k_out"] == r["cpu_s"] for r in rows)
        pids = set(snap)
    finally:
        server.stop(timeout_s=10)
    assert not any(server_process._alive(p) for p in pids)
    assert server_process.port_free(port)


def test_medians_per_server_and_process() -> None:
    def rec(server: str, tok_s: float, cpu: float) -> dict:
        return {"server": server, "concurrency": 32, "output_throughput": tok_s,
                "p99_tpot_ms": 10.0, "server_cpu_s_per_1k_out": cpu,
                "processes": [{"process": "worker", "cpu_s_per_1k_out": cpu}]}

    out = vs.medians([rec("tandem", 100, 1.0), rec("tandem", 300, 3.0), rec("tandem", 200, 2.0),
                      rec("vllm", 50, 5.0)])
    assert [(m["server"], m["runs"], m["output_throughput"]) for m in out] == [
        ("tandem", 3, 200), ("vllm", 1, 50)]
    assert out[0]["cpu_s_per_1k_out_by_process"] == {"worker": 2.0}


def test_skips_without_vllm(tmp_path, capsys) -> None:
    missing = str(tmp_path / "no-venv" / "bin" / "vllm")
    assert "not installed" in (vs.vllm_usable(missing) or "")
    code = vs.main(["--model", str(tmp_path), "--vllm-bin", missing, "--json"])
    assert code == 2
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "not installed" in out["skipped"]["vllm"] and "bench-bin" in out["error"]
