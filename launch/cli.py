"""`python -m launch` / `tandem`: a torchrun-style launcher that also runs a workload.

python -m launch --nproc-per-node 2 --prompt "What is the capital of France?"
python -m launch --model dummy:tiny --num-prompts 64 --input-len 128 --output-len 64 --json
python -m launch --nnodes 2 --node-rank 1 --master-addr HOST --master-port P   # workers only
python -m launch --engine-only --nproc-per-node 2 ...     # scheduler alone, for torchrun workers
python -m launch serve --model dummy:tiny --port 8000      # OpenAI-compatible HTTP server
python -m launch proxy --prefill URL --decode URL --port 8000   # P/D proxy
python -m launch pd --prefill-tp 1 --decode-tp 2 --port 8000   # prefill + decode + proxy
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import time
from typing import Any

from launch.args import add_engine_args, add_torchrun_args, engine_options
from launch.outputs import RequestOutput
from protocol.messages import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description=__doc__.split("\n")[0])
    add_torchrun_args(p)
    add_engine_args(p)
    w = p.add_argument_group("workload")
    w.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    w.add_argument("--prompts-file", help="one prompt per line")
    w.add_argument("--num-prompts", type=int, default=0, help="synthetic: random token prompts")
    w.add_argument("--input-len", type=int, default=128)
    w.add_argument("--output-len", type=int, default=64)
    w.add_argument("--max-tokens", type=int, default=128)
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--top-p", type=float, default=1.0)
    w.add_argument("--top-k", type=int, default=0)
    w.add_argument("--ignore-eos", action="store_true")
    w.add_argument("--raw", action="store_true", help="do not apply the chat template")
    w.add_argument("--json", action="store_true", help="print one JSON object last")
    w.add_argument("--health", action="store_true", help="print every rank's liveness and exit")
    w.add_argument(
        "--engine-only",
        action="store_true",
        help="start only the engine core; workers come from `torchrun ... -m workers`",
    )
    return p


def _signals_to_exceptions() -> None:
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)


def _workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[Any], SamplingParams, bool]:
    """(prompts, params, text?) from --prompt / --prompts-file / --num-prompts."""
    texts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            texts += [line.rstrip("\n") for line in f if line.strip()]
    if texts:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            ignore_eos=args.ignore_eos,
            seed=args.seed if args.temperature > 0 else None,
        )
        return texts, params, True
    n = args.num_prompts or 1
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(args.input_len)] for _ in range(n)]
    params = SamplingParams(
        max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True
    )
    return prompts, params, False


def summarize(outs: list[RequestOutput], elapsed: float) -> dict[str, Any]:
    ttfts = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    out_tokens = sum(len(o.token_ids) for o in outs)
    return {
        "requests": len(outs),
        "errors": sum(o.finish_reason == "error" for o in outs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "output_tokens_per_s": out_tokens / elapsed if elapsed > 0 else 0.0,
        "ttft_median_ms": statistics.median(ttfts) * 1e3 if ttfts else None,
        "tpot_median_ms": statistics.median(tpots) * 1e3 if tpots else None,
    }


def run_node(args: argparse.Namespace) -> int:
    """--node-rank > 0: only this node's workers, connected to the master's engine core."""
    import msgspec

    from launch.processes import ProcessGroup, base_env, start_workers
    from protocol.config import EngineConfig
    from protocol.transport import tcp_endpoints

    port = args.master_port or 29500
    config = EngineConfig(
        model=args.model,
        tensor_parallel_size=args.nproc_per_node * args.nnodes,
        **engine_options(args),
    )
    from workers.device_check import check_node

    try:  # this node's ranks and GPUs, before anything is spawned
        device = check_node(config.device, config.dtype, tp_size=config.tensor_parallel_size,
                            local_ranks=args.nproc_per_node)
    except ValueError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 1
    config = msgspec.structs.replace(config, device=device)
    group = ProcessGroup()
    env = base_env(config, tcp_endpoints(args.master_addr, port + 1))
    try:
        start_workers(
            group,
            env,
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=port,
        )
        while True:
            cause = group.first_exit()
            if cause is not None:
                ok = all(c.proc.poll() == 0 for c in group.children if c.proc.poll() is not None)
                if not ok:
                    print(f"tandem: error: {cause}", file=sys.stderr)
                    return 1
                if group.wait_all(2.0):
                    return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        return 130
    finally:
        group.terminate()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # `tandem serve ...`: the OpenAI-compatible HTTP server
        from launch.serve.main import main as serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["proxy"]:  # `tandem proxy ...`: the P/D proxy
        from launch.proxy.main import main as proxy_main

        return proxy_main(argv[1:])
    if argv[:1] == ["pd"]:  # `tandem pd ...`: a whole P/D set on this host
        from launch.pd import main as pd_main

        return pd_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    from launch.lora_modules import files_error
    from protocol.config import EngineConfig, config_error

    options = engine_options(args)
    err = config_error(EngineConfig(**options)) or files_error(options.get("lora_modules", []))
    if err is not None:
        parser.error(err)
    _signals_to_exceptions()
    if args.node_rank > 0:
        return run_node(args)
    from launch.llm import LLM

    world = args.nproc_per_node * args.nnodes
    master_port = args.master_port or (29500 if args.nnodes > 1 or args.engine_only else None)
    if args.engine_only:
        # torchrun-started workers need the same engine options: tell the user how.
        import msgspec

        from protocol.config import EngineConfig

        cfg = EngineConfig(model=args.model, tensor_parallel_size=world, **engine_options(args))
        print(
            f"tandem: engine core waits for {world} workers on {args.master_addr}:{master_port}; "
            f"start them with TANDEM_CONFIG='{msgspec.json.encode(cfg).decode()}' torchrun "
            f"--nproc-per-node {args.nproc_per_node} --master-addr {args.master_addr} "
            f"--master-port {master_port} -m workers",
            file=sys.stderr,
        )
    t_start = time.monotonic()
    try:
        with LLM(
            args.model,
            tensor_parallel_size=world,
            nnodes=args.nnodes,
            master_addr=args.master_addr,
            master_port=master_port,
            start_workers=not args.engine_only,
            **engine_options(args),
        ) as llm:
            startup_s = time.monotonic() - t_start
            if args.health:
                h = llm.health()
                print(
                    json.dumps({"alive": h.alive, "last_seen_s": h.last_seen_s, "steps": h.steps})
                )
                return 0 if all(h.alive) else 1
            prompts, params, is_text = _workload(args, llm.info.vocab_size)
            if is_text and not args.raw:
                prompts = [llm.apply_chat_template(p) for p in prompts]
            t0 = time.monotonic()
            outs = llm.generate(prompts, params, use_tqdm=not args.json and len(prompts) > 1)
            elapsed = time.monotonic() - t0
            dead = llm.client.dead_reason if llm.client else None
    except KeyboardInterrupt:
        print("tandem: interrupted; engine shut down", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"tandem: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    summary = summarize(outs, elapsed)
    summary["startup_s"] = startup_s
    if is_text and not args.json:
        for o in outs:
            print(o.text if o.text is not None else o.token_ids)
    if not args.json:
        print(
            f"requests {summary['requests']}  prompt tokens {summary['prompt_tokens']}  "
            f"output tokens {summary['output_tokens']}  "
            f"{summary['output_tokens_per_s']:.1f} output tok/s  "
            f"TTFT median {_ms(summary['ttft_median_ms'])}  "
            f"TPOT median {_ms(summary['tpot_median_ms'])}"
        )
    for o in outs:
        if o.finish_reason == "error" and dead is None:
            print(f"tandem: request {o.request_id} failed: {o.error}", file=sys.stderr)
    if args.json:
        rows = [
            {
                "request_id": o.request_id,
                "text": o.text,
                "token_ids": o.token_ids,
                "finish_reason": o.finish_reason,
                "error": o.error,
            }
            for o in outs
        ]
        print(json.dumps({"outputs": rows, "summary": summary}))
    if dead is not None:
        print(f"tandem: error: {dead.splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f} ms"


if __name__ == "__main__":
    sys.exit(main())
