#!/usr/bin/env bash
# One bounded GPU check of the encoder: device, versions, every `gpu`-marked test, and the GPU
# benchmark (bench.gpu -> gpu.json, gpu.png). On a machine without CUDA the gpu tests skip and
# the benchmark runs its quick CPU form, recording the CUDA-only figures as skipped.
#
# Each part runs under `timeout`; with the defaults the whole run ends within about 7 minutes.
# Exit status: non-zero when a gpu test fails (or errors, or none is collected), when the
# benchmark fails, or when a part runs out of time; the later parts still run.
#
# Environment (all optional):
#   PYTHON                    interpreter (default .venv/bin/python, else python3)
#   GPU_CHECK_OUT             output folder (default bench/out/gpu)
#   GPU_CHECK_QUICK=1         quick benchmark (tiny shapes) even on CUDA
#   GPU_CHECK_TESTS           test paths searched for gpu tests (default tests)
#   GPU_CHECK_TEST_TIMEOUT    seconds for the gpu tests (default 180)
#   GPU_CHECK_BENCH_TIMEOUT   seconds for the benchmark (default 240)
#   GPU_CHECK_BENCH_ARGS      extra arguments for python -m bench.gpu
#   GPU_CHECK_PARTS           which parts run after the device lines (default "tests bench")
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [[ ! -x $PY ]] && ! command -v "$PY" >/dev/null; then
    PY=python3
fi
OUT_DIR=${GPU_CHECK_OUT:-bench/out/gpu}
PARTS=" ${GPU_CHECK_PARTS:-tests bench} "
TESTS=${GPU_CHECK_TESTS:-tests}
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-180}
BENCH_TIMEOUT=${GPU_CHECK_BENCH_TIMEOUT:-240}
export PYTHONUNBUFFERED=1
# everything is built locally; a GPU host may have no network at all
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
mkdir -p "$OUT_DIR"
status=0
started=$SECONDS

echo "== device"
# one interpreter start: a `cuda=` line says whether torch sees CUDA, the rest are versions
# (or what went wrong importing torch)
info=$("$PY" -c '
import importlib.util, platform, torch
triton = "not installed"
if importlib.util.find_spec("triton"):
    import triton as t
    triton = t.__version__
print(f"cuda={int(torch.cuda.is_available())}")
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton}")
' 2>&1)
cuda=$(sed -n 's/^cuda=//p' <<<"$info")
if [[ $cuda == 1 ]]; then
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
    else
        "$PY" -c 'import torch; print(torch.cuda.get_device_name(0), "(no nvidia-smi)")'
    fi
else
    echo "no CUDA device: the CUDA parts are skipped"
fi
grep -v '^cuda=' <<<"$info"

run_tests() {
    echo "== gpu tests (pytest -m gpu $TESTS, at most ${TEST_TIMEOUT}s)"
    local rc summary
    # shellcheck disable=SC2086 # TESTS may name several paths
    timeout -k 10 "$TEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfEs $TESTS \
        2>&1 | tee "$OUT_DIR/gpu-tests.log"
    rc=${PIPESTATUS[0]}
    summary=$(grep -E '^=*.* in [0-9.]+s' "$OUT_DIR/gpu-tests.log" | tail -n 1 | tr -d '=' | xargs)
    case $rc in
        0) echo "gpu tests: ${summary:-passed}" ;;
        5) echo "gpu tests: FAILED, no gpu test was collected"; status=1 ;;
        124 | 137)
            echo "gpu tests: FAILED, out of time after ${TEST_TIMEOUT}s (${summary:-no summary})"
            status=1
            ;;
        *) echo "gpu tests: FAILED (exit $rc): ${summary:-no summary}"; status=1 ;;
    esac
}

run_bench() {
    # new parts stop starting well before the timeout, so a run cut short still has its files
    local budget=$((BENCH_TIMEOUT > 90 ? BENCH_TIMEOUT - 45 : BENCH_TIMEOUT / 2))
    local args=(--out "$OUT_DIR" --budget-s "$budget") rc
    if [[ ${GPU_CHECK_QUICK:-0} == 1 || $cuda != 1 ]]; then
        args+=(--quick)
    fi
    # shellcheck disable=SC2206 # word splitting of the extra arguments is wanted
    args+=(${GPU_CHECK_BENCH_ARGS:-})
    echo "== benchmark (python -m bench.gpu ${args[*]}, at most ${BENCH_TIMEOUT}s)"
    timeout -k 10 "$BENCH_TIMEOUT" "$PY" -m bench.gpu "${args[@]}"
    rc=$?
    case $rc in
        0) echo "benchmark: wrote $OUT_DIR/gpu.json and $OUT_DIR/gpu.png" ;;
        124 | 137) echo "benchmark: FAILED, out of time after ${BENCH_TIMEOUT}s"; status=1 ;;
        *) echo "benchmark: FAILED (exit $rc)"; status=1 ;;
    esac
}

[[ $PARTS == *" tests "* ]] && run_tests
[[ $PARTS == *" bench "* ]] && run_bench

echo "== gpu check done in $((SECONDS - started))s: $([[ $status == 0 ]] && echo ok || echo FAILED)"
exit $status
