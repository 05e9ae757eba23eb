#!/usr/bin/env bash
# One device call: doctor, the GPU test suite, then the benchmarks, logs under $OUT.
#   bash benchmarks/run_gpu.sh [tests] [sweep] [overhead] [bench] [harness]     (default: tests bench)
# Results land in $OUT/results/ (softmax.json, softmax.md, gpu-tests.log, doctor.log).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kernelforge-out}
mkdir -p "$OUT/results"
stages=${*:-tests bench}
status=0
python3 -m kernelforge.cli doctor 2>&1 | tee "$OUT/results/doctor.log"
for stage in $stages; do
  case $stage in
    tests) timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/results/gpu-tests.log" | tail -40
           status=$(( status | ${PIPESTATUS[0]} )) ;;
    sweep) timeout 420 python3 benchmarks/softmax_sweep.py --out "$OUT/results" > "$OUT/results/sweep.log" 2>&1
           status=$(( status | $? )); tail -3 "$OUT/results/sweep.log" ;;
    overhead) timeout 300 python3 benchmarks/softmax_overhead.py > "$OUT/results/overhead.log" 2>&1
           status=$(( status | $? )); head -14 "$OUT/results/overhead.log" ;;
    harness) timeout 540 python3 -m kernelforge.cli bench all --crosscheck --out "$OUT/results" > "$OUT/results/harness.log" 2>&1
           status=$(( status | $? )); tail -5 "$OUT/results/harness.log" ;;
    bench) timeout 420 python3 benchmarks/softmax.py --out "$OUT/results" > "$OUT/results/bench.log" 2>&1
           status=$(( status | $? )); cat "$OUT/results/softmax.md" ;;
  esac
done
exit $status
