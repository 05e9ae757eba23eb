#!/usr/bin/env bash
# One device call: doctor, then the stages asked for, logs and results under $OUT.
#   bash benchmarks/run_gpu.sh [build] [tests] [harness] [sweep]   (default: build tests)
#   build    compile every CUDA extension, in parallel, into .kfcache/ (kept on a warm machine)
#   tests    the GPU suite (pytest -m gpu): op tests spread over 8 workers file by file (test by
#            test, workers compile the same kernels at once: slower), then the timing tests alone
#   focus    the GPU tests in $FOCUS_TESTS only ($FOCUS_WORKERS, default 8, test by test), e.g.
#            FOCUS_TESTS="tests/ops/test_attention.py"
#   attention-sweep  benchmarks/tuning/attention_sweep.py (tile sweep next to SDPA flash / cuDNN)
#   gemm-sweep  benchmarks/tuning/gemm_sweep.py $GEMM_SWEEP_ARGS (tile configs and a TMA kernel against cuBLAS)
#   gemm-overhead  benchmarks/tools/gemm_overhead.py (host cost per kf.gemm call, and its profile)
#   host     benchmarks/tools/host_overhead.py $HOST_ARGS (host time per call of every op against torch eager,
#            and where it goes; after build, so forced CUDA rows do not build extensions), JSON into results/
#   backend-order  benchmarks/tuning/backend_order.py (device time of the CUDA extension against Triton where
#            an op has both: the measurement behind the ordering rules), JSON into results/
#   profile  benchmarks/tools/profile_ops.py $PROFILE_ARGS (device time per kernel, host profile per call)
#   aot      KERNELFORGE_BUILD_CUDA=1 pip install into /tmp/kfsite; doctor and CUDA op tests against it;
#            AOT_INTO_TREE=1 also copies the built libraries into this tree's kernelforge/cuda/_aot/
#            (later stages of the call then load them instead of building JIT)
#   memcheck / racecheck  compute-sanitizer --tool memcheck / racecheck over each of $MEMCHECK_TESTS /
#            $RACECHECK_TESTS (FILE or FILE:SECONDS; default tests/cuda), $MEMCHECK_K / $RACECHECK_K
#            replacing each file's -k selection, $SANITIZE_JOBS of them at once (default 1)
#   distributed  (2+ GPUs) tests/distributed over NCCL, then examples/08_train_distributed.py on 1, 2, 4 GPUs
#            per plan ($SCALING_PLANS, $SCALING_BATCH sequences a GPU, $SCALING_ARGS): scaling.log;
#            DIST_TESTS=0 skips the tests
#   allreduce  (2+ GPUs) benchmarks/tools/allreduce_probe.py on every GPU under torchrun: all-reduce bandwidth
#            and the GPUs' links, into allreduce.log
#   cpu-tests  the CPU suite ($CPU_TESTS, default tests; $CPU_TESTS_WORKERS) under the machine's torch (2.11
#            there, 2.13 on the CPU machines), Triton's interpreter on numpy < 2.3 from .whl/cpu/ when carried
#   demo     kernelforge demo $DEMO_ARGS (the example models at every level: table, JSON, plot) into demo/
#   script   python3 $SCRIPT (one benchmark or probe script with its arguments) into script.log
#   sweep    benchmarks/tuning/softmax_sweep.py (the Triton softmax launch configs), JSON into results/
#   harness  kernelforge bench $BENCH_OPS (default all) --dtype $BENCH_DTYPE (default bf16) --crosscheck
# Everything lands in $OUT/results/ and is packed into $OUT/results.tgz (the device returns
# at most 8 files), exactly as produced.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KERNELFORGE_CACHE_DIR=$PWD/.kfcache
install_wheels() {  # TARGET WHEEL...: carried wheels into a site of their own, once a machine
  [ -d "$1" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$@"
}
if [ -d .whl ]; then  # peers carried as wheels (Liger-Kernel is not on the GPU image); installed once a
  # machine, so that several invocations started side by side (one a GPU) do not install over each other
  install_wheels /tmp/site .whl/*.whl
  [ -d /tmp/site ] && export PYTHONPATH=$PWD:/tmp/site
fi
OUT=${OUT:-/tmp/kernelforge-out}
R=$OUT/results
mkdir -p "$R"
stages=${*:-build tests}
SWEEP_ARGS=${SWEEP_ARGS:-}
status=0
# DOCTOR=0 skips the doctor (it measures the ceilings: ~1 minute)
[ "${DOCTOR:-1}" = 0 ] || python3 -m kernelforge.cli doctor > "$R/doctor.log" 2>&1
sanitize() {  # STAGE ENTRY [K]: one file or node id under compute-sanitizer, its log under $R
  local stage=$1 entry=$2 file=$2 limit=${SANITIZE_TIMEOUT:-200} k rc log
  case ${entry##*:} in ''|*[!0-9]*) ;; *) file=${entry%:*}; limit=${entry##*:} ;; esac
  case $file in tests/ops/*|tests/test_special_values.py*) k="cuda-cuda or triton-cuda or opcheck[cuda]" ;;
    *) k="not speed" ;; esac
  [ -n "${3:-}" ] && k=$3
  log="$R/$stage-$(echo "${file#tests/}" | sed 's/\.py//; s/::/-/g; s#/#-#g').log"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$limit" compute-sanitizer --tool "$stage" \
    --error-exitcode 99 --print-limit 20 python3 -m pytest -m gpu -v -p no:cacheprovider -p no:xdist \
    -k "$k" "$file" > "$log" 2>&1
  rc=$?; echo "$stage $file: exit $rc $(grep -E "ERROR SUMMARY|passed|failed" "$log" | tail -n 2 | tr '\n' ' ')"
  return $rc
}
for stage in $stages; do
  start=$SECONDS
  case $stage in
    build)
      for ext in $(python3 -c "from kernelforge.cuda.extensions import discover; print(*discover())"); do
        python3 -c "from kernelforge.cuda.compiler import get_cuda_compiler as g; g().load('$ext')" \
          > "$R/build-$ext.log" 2>&1 &
      done
      for job in $(jobs -p); do wait "$job"; status=$(( status | $? )); done
      tail -n 3 "$R"/build-*.log ;;
    tests)
      timeout "${TESTS_TIMEOUT:-500}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs -n 8 --dist loadfile \
        --durations=10 --ignore tests/bench \
        > "$R/gpu-tests.log" 2>&1
      status=$(( status | $? ))
      timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/bench > "$R/gpu-tests-timing.log" 2>&1
      status=$(( status | $? ))
      grep -E "^(FAILED|ERROR)" "$R/gpu-tests.log" | head -60; tail -n 2 "$R/gpu-tests.log" "$R/gpu-tests-timing.log" ;;
    focus)
      # SIGINT at the limit: pytest still prints its summary of what ran (a kill would lose it)
      KERNELFORGE_FAILURE_LOG="$R/gpu-focus-failures.log" \
        timeout -s INT -k 30 "${FOCUS_TIMEOUT:-420}" python3 -m pytest -m gpu -v -p no:cacheprovider -rfEs \
        -n "${FOCUS_WORKERS:-8}" --durations=15 -k "${FOCUS_K:-}" $FOCUS_TESTS \
        > "$R/gpu-focus-tests.log" 2>&1
      status=$(( status | $? ))
      grep -E "(FAILED|ERROR) tests/" "$R/gpu-focus-tests.log" | head -40; tail -n 2 "$R/gpu-focus-tests.log" ;;
    attention-sweep)
      timeout "${SWEEP_TIMEOUT:-400}" python3 benchmarks/tuning/attention_sweep.py --out "$R" $SWEEP_ARGS > "$R/attention-sweep.log" 2>&1
      status=$(( status | $? )); grep -v "^   " "$R/attention-sweep.log" | tail -n 14 ;;
    gemm-sweep)
      timeout "${GEMM_SWEEP_TIMEOUT:-300}" python3 benchmarks/tuning/gemm_sweep.py ${GEMM_SWEEP_ARGS:-} > "$R/gemm-sweep.log" 2>&1
      status=$(( status | $? )); tail -n 4 "$R/gemm-sweep.log" ;;
    gemm-overhead)
      timeout 120 python3 benchmarks/tools/gemm_overhead.py > "$R/gemm-overhead.log" 2>&1
      status=$(( status | $? )); head -n 15 "$R/gemm-overhead.log" ;;
    host)
      timeout 300 python3 benchmarks/tools/host_overhead.py --out "$R" ${HOST_ARGS:-} > "$R/host.log" 2>&1
      status=$(( status | $? )); sed -n '1,/^$/p' "$R/host.log" | head -n 60; tail -n 2 "$R/host.log" ;;
    backend-order)
      timeout 300 python3 benchmarks/tuning/backend_order.py --out "$R" > "$R/backend-order.log" 2>&1
      status=$(( status | $? )); awk '$NF + 0 > 1.0' "$R/backend-order.log" | head -n 30; tail -n 1 "$R/backend-order.log" ;;
    harness)
      timeout "${BENCH_TIMEOUT:-540}" python3 -m kernelforge.cli bench ${BENCH_OPS:-all} --dtype "${BENCH_DTYPE:-bf16}" \
        --crosscheck --out "$R" > "$R/harness.log" 2>&1
      status=$(( status | $? )); tail -n 5 "$R/harness.log" ;;
    profile)
      timeout "${PROFILE_TIMEOUT:-200}" python3 benchmarks/tools/profile_ops.py ${PROFILE_ARGS:-} > "$R/profile.log" 2>&1
      status=$(( status | $? )); tail -n 20 "$R/profile.log" ;;
    aot)  # the ahead-of-time build: pip install into /tmp/kfsite, then the CUDA GPU tests and the doctor
          # against that install, with an empty JIT cache (anything built JIT shows up in it)
      rm -rf /tmp/kfsite /tmp/kf-jit-empty
      KERNELFORGE_BUILD_CUDA=1 timeout "${AOT_TIMEOUT:-400}" python3 -m pip install -v --no-build-isolation --no-deps \
        --no-index --target /tmp/kfsite . > "$R/aot-build.log" 2>&1
      status=$(( status | $? )); tail -n 3 "$R/aot-build.log"; ls /tmp/kfsite/kernelforge/cuda/_aot | tee -a "$R/aot-build.log"
      (cd /tmp && PYTHONPATH=/tmp/kfsite KERNELFORGE_CACHE_DIR=/tmp/kf-jit-empty python3 -m kernelforge.cli doctor) \
        > "$R/aot-doctor.log" 2>&1
      grep "cuda extension" "$R/aot-doctor.log"
      # the tests run from a copy holding only tests/ (python -m pytest puts the working directory
      # first on sys.path: from the checkout, kernelforge would be imported from the tree)
      rm -rf /tmp/kf-aot-tests && mkdir /tmp/kf-aot-tests && cp -r tests pyproject.toml /tmp/kf-aot-tests/
      (cd /tmp/kf-aot-tests && PYTHONPATH=/tmp/kfsite python3 -c "import kernelforge; print('kernelforge from', \
        kernelforge.__file__)" && PYTHONPATH=/tmp/kfsite KERNELFORGE_CACHE_DIR=/tmp/kf-jit-empty \
        timeout "${AOT_TESTS_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 \
        -k "${AOT_K:-cuda-cuda or opcheck}" ${AOT_TESTS:-tests/ops}) > "$R/aot-gpu-tests.log" 2>&1
      status=$(( status | $? )); head -n 1 "$R/aot-gpu-tests.log"; tail -n 2 "$R/aot-gpu-tests.log"
      echo "JIT builds during the AOT tests: $(ls /tmp/kf-jit-empty/cuda 2>/dev/null | wc -l)" | tee -a "$R/aot-gpu-tests.log"
      [ "${AOT_INTO_TREE:-0}" = 1 ] && cp /tmp/kfsite/kernelforge/cuda/_aot/*.so /tmp/kfsite/kernelforge/cuda/_aot/*.json \
        kernelforge/cuda/_aot/ ;;
    memcheck|racecheck)  # compute-sanitizer's memcheck (out-of-bounds and misaligned accesses) or racecheck
               # (shared-memory hazards) over GPU tests, each entry in its own process (no xdist: the
               # sanitizer crashed bringing up its workers), the caching allocator off so every
               # out-of-bounds access is seen. $MEMCHECK_TESTS / $RACECHECK_TESTS: entries TEST or
               # TEST:SECONDS (a file or a pytest node id); op tests keep their CUDA- and Triton-backend
               # cases on the GPU, other files all but timing tests ($MEMCHECK_K / $RACECHECK_K replace
               # that -k selection)
      tests_var=${stage^^}_TESTS; k_var=${stage^^}_K
      for entry in ${!tests_var:-tests/cuda}; do
        # $SANITIZE_JOBS entries at once (default 1; more not yet tried on a device)
        while [ "$(jobs -rp | wc -l)" -ge "${SANITIZE_JOBS:-1}" ]; do wait -n; status=$(( status | $? )); done
        sanitize "$stage" "$entry" "${!k_var:-}" &
      done
      for job in $(jobs -p); do wait "$job"; status=$(( status | $? )); done ;;
    distributed)  # a machine of 2+ GPUs: tests/distributed over NCCL (one GPU a rank; jobs needing more
                  # ranks than GPUs skip), then the training entry point on 1, 2, 4 GPUs (as many as
                  # there are) per plan in $SCALING_PLANS at a fixed batch a GPU: tokens/s a GPU, peak memory
      if [ "${DIST_TESTS:-1}" = 1 ]; then  # DIST_TESTS=0: the scaling runs alone
        NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} KERNELFORGE_DIST_BACKEND=nccl timeout "${DIST_TESTS_TIMEOUT:-300}" \
          python3 -m pytest -q -p no:cacheprovider -rfEs -m "not gpu" tests/distributed > "$R/distributed-tests.log" 2>&1
        status=$(( status | $? )); grep -E "^(FAILED|ERROR)" "$R/distributed-tests.log" | head -20
        tail -n 2 "$R/distributed-tests.log"
      fi
      gpus=$(nvidia-smi -L | wc -l)
      for plan in ${SCALING_PLANS:-none ddp fsdp2 tp pp}; do
        for n in 1 2 4; do
          [ "$n" -le "$gpus" ] || continue
          [ "$plan" = none ] && [ "$n" -gt 1 ] && continue
          [ "$plan" != none ] && [ "$n" -eq 1 ] && continue
          per_gpu=${SCALING_BATCH:-8}  # sequences a GPU a step (TP: every rank the whole batch)
          extra=""  # tp and pp: every rank the whole batch (pp in 4 micro-batches); else each rank its part
          if [ "$plan" = tp ] || [ "$plan" = pp ]; then batch=$per_gpu; else batch=$(( per_gpu * n )); fi
          [ "$plan" = pp ] && extra="--microbatches 4"
          echo "== $plan on $n GPU(s), batch $batch" >> "$R/scaling.log"
          NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} timeout "${SCALING_TIMEOUT:-120}" torchrun --standalone \
            --nproc_per_node "$n" examples/08_train_distributed.py --parallel "$plan" --batch-size "$batch" $extra \
            ${SCALING_ARGS:---level triton --dtype bfloat16 --dim 1024 --layers 8 --heads 16 --seq-len 1024 --steps 40 --log-every 10} \
            >> "$R/scaling.log" 2>&1
          status=$(( status | $? ))
        done
      done
      grep -E "^== |^step [0-9]+/[0-9]+ .*tok/s" "$R/scaling.log" | tail -n 40 ;;
    allreduce)
      NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} timeout 180 torchrun --standalone --nproc_per_node "$(nvidia-smi -L | wc -l)" \
        benchmarks/tools/allreduce_probe.py > "$R/allreduce.log" 2>&1
      status=$(( status | $? )); head -n 8 "$R/allreduce.log" ;;
    demo)
      timeout "${DEMO_TIMEOUT:-400}" python3 -m kernelforge.cli demo --out "$R/demo" ${DEMO_ARGS:-} > "$R/demo.log" 2>&1
      status=$(( status | $? )); tail -n 30 "$R/demo.log" ;;
    cpu-tests)  # the CPU suite (or $CPU_TESTS) under this machine's torch (2.11: the other supported
      # version), GPUs hidden, Triton through its interpreter, which needs numpy < 2.3: a wheel of it
      # carried in .whl/cpu/ goes into a site of its own, ahead of the image's numpy for this stage only
      site=/tmp/cpu-site
      [ -d .whl/cpu ] && install_wheels "$site" .whl/cpu/*.whl
      # SIGINT at the limit: pytest still prints its summary (which tests failed) before it exits
      PYTHONPATH="$site:$PYTHONPATH" CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 timeout -s INT -k 30 "${CPU_TESTS_TIMEOUT:-500}" \
        python3 -m pytest -m "not gpu" -q -p no:cacheprovider -rfEs -n "${CPU_TESTS_WORKERS:-12}" --dist loadfile \
        ${CPU_TESTS:-tests} > "$R/cpu-tests.log" 2>&1
      status=$(( status | $? )); grep -E "^(FAILED|ERROR)" "$R/cpu-tests.log" | head -40; tail -n 2 "$R/cpu-tests.log" ;;
    script)  # any one script: SCRIPT="benchmarks/tools/x.py --args"
      timeout "${SCRIPT_TIMEOUT:-200}" python3 $SCRIPT > "$R/script.log" 2>&1
      status=$(( status | $? )); tail -n 30 "$R/script.log" ;;
    sweep) timeout 420 python3 benchmarks/tuning/softmax_sweep.py --out "$R" > "$R/sweep.log" 2>&1
      status=$(( status | $? )); tail -n 3 "$R/sweep.log" ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
  echo "== $stage: $(( SECONDS - start )) s, status so far $status"
done
tar -czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$R"
exit $status
