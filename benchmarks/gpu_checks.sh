#!/usr/bin/env bash
# Issue #7 on a machine with several GPUs: the parallel checks over NCCL, and S1 at TP=2
# against TP=1.
#
#   benchmarks/gpu_checks.sh tests   # every CUDA variant of the parallel tests, one pytest call
#   benchmarks/gpu_checks.sh s1      # S1 decode throughput at TP=1 and TP=2 (ours only)
#   benchmarks/gpu_checks.sh all     # both, tests first
#
# Run it with the Python that holds torch (python3 on the GPU machine; PYTHON=... to choose),
# the carried wheels installed and on PYTHONPATH (benchmarks/README.md, "GPU
# machine: packages to carry"). Extra arguments after the mode go to pytest (tests) or to
# the S1 script (s1). The CUDA variants are the test ids with "cuda" in them. They need two
# GPUs, and four for the FLUX.2 DiT and Ulysses layouts (fewer: those skip and say why).
# On a machine without GPUs everything skips in a few seconds.
#
# Each mode should fit in one 10-minute device command (an estimate: not yet run on GPUs);
# "all" may not.
# Logs and the S1 record go to $OUT when it is set.
set -uo pipefail

mode="${1:-tests}"
shift || true
PY="${PYTHON:-python3}"
cd "$(dirname "$0")/.." || exit 1  # the repository root: the servers the tests start import mstar from it
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-/tmp/mstar-gpu-checks}"
mkdir -p "$out"

# Keep NVLink multicast off (the machine's rule), float32 without TF32 in every process the
# tests start, and unbuffered output so that a log cut short still says where it stopped.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NVIDIA_TF32_OVERRIDE=0 PYTHONUNBUFFERED=1

TESTS=(
  tests/distributed                      # Llama and Qwen3.5 TP=2, FLUX.2 DiT SP/TP/TPxSP, Ulysses, TP runtime, transports
  tests/e2e/test_tp_server.py            # mstar serve with llm at TP=2 (SHM and TCP)
  tests/e2e/test_pd_disagg.py            # prefill on GPU 0, decode on GPU 1 (SHM and TCP)
  tests/e2e/test_orpheus_transports.py   # talker and codec on two GPUs (needs snac and openai)
  tests/runtime/test_cfg_parallel.py     # CFG branches on two GPUs against the batched pair
)

report() {
  "$PY" - <<'EOF'
import importlib.util, torch
print(f"torch {torch.__version__}, CUDA GPUs: {torch.cuda.device_count()}, NCCL: {torch.distributed.is_nccl_available()}")
missing = [m for m in ("msgspec", "zmq", "pydantic", "fastapi", "uvicorn", "httpx", "diffusers", "transformers",
                       "safetensors", "PIL", "snac", "openai", "pytest_timeout")
           if importlib.util.find_spec(m) is None]
print("missing packages (their tests skip or fail to import):", ", ".join(missing) or "none")
EOF
}

run_tests() {
  local timeout=()
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    timeout=(--timeout=300)  # one hung test must not eat the whole command
  fi
  "$PY" -m pytest -q -rs --durations=15 --continue-on-collection-errors "${timeout[@]}" \
    -k cuda "${TESTS[@]}" "$@" 2>&1 | tee "$out/gpu_checks_tests.log"
}

run_s1() {
  # The fast paths (Triton attention, CUDA-graph decode) at both sizes; the eager engine is
  # too slow at 64 streams for one command. A size that fails is recorded in the JSON's
  # errors; then the eager engine measures 1 and 16 streams instead.
  "$PY" benchmarks/s1_llama_decode.py --tp-sizes 1,2 --skip-baseline --attention-backend triton --cuda-graphs \
    --out "$out" "$@" 2>&1 | tee "$out/gpu_checks_s1.log"
  local status=$?
  if [ "$status" -ne 0 ]; then
    echo "S1 with the fast paths failed (exit $status): eager engine, 1 and 16 streams" >&2
    "$PY" benchmarks/s1_llama_decode.py --tp-sizes 1,2 --skip-baseline --streams 1,16 --latency-runs 1 \
      --out "$out" "$@" 2>&1 | tee "$out/gpu_checks_s1_eager.log"
    status=$?
  fi
  return "$status"
}

report
case "$mode" in
  tests) run_tests "$@" ;;
  s1) run_s1 "$@" ;;
  all) run_tests; tests_status=$?; run_s1; s1_status=$?; exit $(( tests_status || s1_status )) ;;
  *) echo "usage: $0 [tests|s1|all] [extra arguments]" >&2; exit 2 ;;
esac
