#!/usr/bin/env bash
# Issue 24's GPU checks as one prepared script for a lent GPU (the `device` tool's machine: torch
# with CUDA, nvcc, compute-sanitizer, pytest-xdist; ../shared/reference/gpu.md). Logs go to
# $OUT (default ./gpu_out). Stages run in the order given (default: all of them):
#
#   build     the extension for sm_90 only (QCONF_CUDA_ARCHS=90, ~100 s), in place
#   wheels    pip install --no-deps every wheel under ./wheels (torchao, bitsandbytes: brought
#             along, the machine reaches no registry)
#   tests     tests/gpu with the generic and the specialized kernels (OMP_NUM_THREADS=1, -n 13)
#   sanitize  compute-sanitizer memcheck and racecheck on the fused-step tests (Muon's two calls too)
#   bench     qconf bench --device cuda --size gpu (537M params; ~68 GiB with every contender, so on
#             an 80 GB H100 give CONTENDERS, e.g. 'qconf-fused-*' then 'torchao-*,bnb-*')
#   memory    qconf bench --memory --device cuda (issue 50's point 2: peak B/param of training)
#   bitlinear benchmarks/bench_bitlinear.py --device cuda, fp32 then bf16 inputs (point 4)
#
# Stages not named run only when named: the default is build wheels tests sanitize bench.
#
# e.g. bash benchmarks/gpu_check.sh build tests sanitize    then    bash benchmarks/gpu_check.sh bench
# (the build stays on a warm machine between calls). Each stage's exit status is in $OUT/status.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(build wheels tests sanitize bench)

stage() {  # stage NAME COMMAND...: run it with a log, record its status, go on either way
  local name=$1
  shift
  local t0=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/status"
}

for s in "${STAGES[@]}"; do
  case $s in
    build)
      nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
      stage build env QCONF_CUDA_ARCHS=90 MAX_JOBS=16 "$PY" setup.py build_ext --inplace ;;
    wheels)
      if compgen -G "wheels/*.whl" >/dev/null; then stage wheels "$PY" -m pip install --no-deps wheels/*.whl; fi ;;
    tests)
      # --max-worker-restart: a crashing kernel ends the run after a few workers, not after dozens
      stage tests_generic env OMP_NUM_THREADS=1 "$PY" -m pytest tests/gpu -n 13 -p no:benchmark -q -rs \
        --max-worker-restart 2
      stage tests_specialized env OMP_NUM_THREADS=1 QCONF_CUDA_KERNELS=specialized \
        "$PY" -m pytest tests/gpu -n 13 -p no:benchmark -q -rs --max-worker-restart 2 ;;
    sanitize)
      for tool in memcheck racecheck; do
        stage "sanitize_$tool" env QCONF_CUDA_KERNELS=specialized compute-sanitizer --tool "$tool" \
          --launch-timeout 120 --error-exitcode 3 "$PY" -m pytest tests/gpu/test_specialized_cuda.py \
          tests/gpu/test_muon_cuda.py -x -q -p no:benchmark -k "equals_cpu or large or odd or equal_the_cpu_fused"
      done ;;
    bench)
      stage bench "$PY" -c 'import sys; from qconf.cli import main; sys.exit(main())' bench --device cuda --size gpu --rounds "${ROUNDS:-20}" --threads 16 \
        ${CONTENDERS:+--contenders "$CONTENDERS"} --json "$OUT/bench.json" ;;
    memory)
      stage memory "$PY" -c 'import sys; from qconf.cli import main; sys.exit(main())' bench --memory --device cuda \
        --json "$OUT/memory.json" ;;
    bitlinear)
      for dtype in fp32 bf16; do
        stage "bitlinear_$dtype" "$PY" benchmarks/bench_bitlinear.py --device cuda --input-dtype "$dtype" \
          --json "$OUT/bitlinear_$dtype.json"
      done ;;
    *)
      echo "unknown stage '$s' (build, wheels, tests, sanitize, bench, memory, bitlinear)" >&2
      exit 2 ;;
  esac
done
