#!/usr/bin/env bash
# One command for a lent GPU (through the device tool, <= 8 minutes): install the carried
# wheels, run the CUDA tests, the Triton tests on CUDA tensors, HF parity on CUDA, the compile
# check and the benchmarks, then print one JSON summary as the last line.
#   bash scripts/gpu_check.sh            (the device tool runs it from the repository root)
# Carry the wheels the GPU image lacks in .whl/ first (see README, "GPU check").
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-deps --no-index .whl/*.whl > "$OUT/pip.txt" 2>&1 || true
fi
status() { [ "$1" -eq 0 ] && echo pass || echo "fail($1)"; }
run_tests() {  # name, timeout, pytest args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python -m pytest -q -x "$@" > "$OUT/$name.txt" 2>&1
  echo "\"$name\": \"$(status $?)\""
}
bench() {  # name, script, args...: the JSON line of a benchmark, or null
  local name=$1 script=$2; shift 2
  timeout 120 python "scripts/$script" --json "$@" > "$OUT/$name.txt" 2>&1
  local last; last=$(tail -n 1 "$OUT/$name.txt")
  case "$last" in "{"*) echo "\"$name\": $last";; *) echo "\"$name\": null";; esac
}
parts=()
parts+=("$(run_tests cuda_e2e 150 tests/e2e/test_cuda_path.py)")
# the Triton tests on CUDA tensors: the interpreter off (its conftest sets it only without CUDA)
parts+=("$(TRITON_INTERPRET=0 run_tests triton_cuda 90 tests/workers/triton)")
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
head=$(python -c 'import json, torch, triton
print(json.dumps({"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
                  "torch": torch.__version__, "triton": triton.__version__})[1:-1])')
IFS=,; echo "{$head, ${parts[*]}}"
