#!/usr/bin/env bash
# The differential fuzzer's GPU run (issue 30), as parallel Hypothesis seeds on one GPU: each process draws
# EXAMPLES cases of tests/test_sdpa_fidelity.py::test_fuzz_every_backend_gpu, naming every case in its trace before
# running it (a case that breaks the CUDA context cannot be replayed by Hypothesis). Prints the cases run, and each
# failing seed with its repro or, for a crash, its last traced case.
# Usage (repository root, on the device machine):
#   bash tools/gpu_fuzz.sh OUTDIR [PROCS] [EXAMPLES] [SECONDS] [FIRST_SEED]
# FUZZ_TEST=FILE::TEST runs another fuzzer the same way (the gradient fuzzer:
# tests/test_grad_fuzz.py::test_grad_fuzz_gpu, which reads its budget from GRAD_FUZZ_GPU, traces to the same file and
# writes each case's outcome beside it: counted at the end, since the clock stops most runs before Hypothesis prints
# its statistics).
# Measured (session 26, 2x H100 host, 32 cores, processes dealt over both GPUs): 24 processes ran 7,981 cases in
# 450 s (0.7-1.0 case/s a process). 10,000 cases: two calls with different seeds (FIRST_SEED 1, then 25).
set -uo pipefail
out=${1:?OUTDIR}; procs=${2:-16}; examples=${3:-700}; seconds=${4:-500}; first=${5:-1}
repo=$(pwd)
mkdir -p "$out"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c GPU); [ "$ngpu" -ge 1 ] || ngpu=1
read -r -a gpus <<< "${FUZZ_GPUS:-$(seq -s ' ' 0 $((ngpu - 1)))}"  # FUZZ_GPUS="1": leave GPU 0 to another job
test=${FUZZ_TEST:-tests/test_sdpa_fidelity.py::test_fuzz_every_backend_gpu}
for s in $(seq "$first" $((first + procs - 1))); do  # the processes dealt over the GPUs
  (cd /tmp && CUDA_VISIBLE_DEVICES=${gpus[$(( s % ${#gpus[@]} ))]} SDPA_FUZZ_TRACE="$out/trace_$s.txt" \
     SDPA_FUZZ_EXAMPLES="$examples" GRAD_FUZZ_GPU="$examples" timeout "$seconds" \
     python3 -m pytest -q -p no:cacheprovider -p no:logging -c "$repo/pyproject.toml" --rootdir "$repo" \
     "$repo/${test%%::*}" -m gpu -k "${test##*::}" --hypothesis-seed="$s" \
     --hypothesis-show-statistics > "$out/fuzz_$s.log" 2>&1; echo "rc=$?" >> "$out/fuzz_$s.log") &
done
wait
total=0
for s in $(seq "$first" $((first + procs - 1))); do
  n=$(grep -c . "$out/trace_$s.txt" 2>/dev/null || echo 0); total=$((total + n))
  rc=$(grep -o "rc=[0-9]*" "$out/fuzz_$s.log" | tail -1)
  case "$rc" in
    rc=0) ;;
    rc=124) echo "seed $s: $n cases, stopped by the clock" ;;
    *) echo "seed $s: $n cases, $rc"; grep -m2 "why =\|AssertionError:" "$out/fuzz_$s.log" | cut -c1-300
       grep -m1 "check(Case" "$out/fuzz_$s.log" | cut -c1-600 || true
       echo "  last traced: $(tail -1 "$out/trace_$s.txt" 2>/dev/null | cut -c1-600)" ;;
  esac
done
if ls "$out"/trace_*.txt.outcomes >/dev/null 2>&1; then  # the gradient fuzzer's outcome of each case, counted
  cat "$out"/trace_*.txt.outcomes > "$out/outcomes.txt"; rm -f "$out"/trace_*.txt.outcomes
  echo "outcomes:"; sort "$out/outcomes.txt" | uniq -c | sort -rn | head -60
fi
cat "$out"/trace_*.txt > "$out/cases.txt" 2>/dev/null; rm -f "$out"/trace_*.txt
echo "cases run: $total"
