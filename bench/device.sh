#!/usr/bin/env bash
# One command for a GPU machine that cannot download (docs/device.md): install the wheels that
# `make device-wheels` put in .whl/, run tests/test_cuda.py, bench/device_step.py (the decode step) and
# bench/throughput.py's device-quant section,
# and write one report, device-report.md, under $OUT (or --out DIR). No Ray: the engine runs in-process.
#
#   bash bench/device.sh                  # on the GPU machine (carry .whl)
#   bash bench/device.sh --device cpu     # a dry run here: small shapes, the CUDA-only tests skip
set -uo pipefail
cd "$(dirname "$0")/.."

device=cuda
out=${OUT:-runs/device}
while [ $# -gt 0 ]; do
    case $1 in
        --device) device=${2:-}; shift 2 ;;
        --out) out=${2:-}; shift 2 ;;
        *) echo "bench/device.sh: unknown argument '$1': use --device cuda|cpu and --out DIR" >&2; exit 2 ;;
    esac
done
case $device in cuda|cpu) ;; *) echo "bench/device.sh: --device must be cuda or cpu, not '$device'" >&2; exit 2 ;; esac

python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
wheels=${DEVICE_WHEELS:-.whl}
site=${KVBATCH_SITE:-/tmp/kvbatch-site}
if ls "$wheels"/*.whl >/dev/null 2>&1 && ! "$python" -c 'import pydantic, zstandard' 2>/dev/null; then
    rm -rf "$site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl \
        || { echo "bench/device.sh: installing $wheels/*.whl failed: rebuild them with 'make device-wheels'" >&2; exit 1; }
elif ! "$python" -c 'import pydantic, zstandard' 2>/dev/null; then
    echo "bench/device.sh: $python lacks pydantic and zstandard: run 'make device-wheels' and carry $wheels" >&2
    exit 1
fi
# the project runs from this checkout (nothing is installed on that machine), the wheels ahead of the image's
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1  # the image's pytest plugins were built for its own pytest
# indexed: torch.cuda.set_per_process_memory_fraction (the OOM test) raises ValueError for a plain `cuda`
if [ "$device" = cuda ]; then export KVBATCH_TEST_DEVICE=cuda:0; else export KVBATCH_TEST_DEVICE=cpu; fi

mkdir -p "$out"
report="$out/device-report.md"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# each step's most seconds: on CUDA 120 + 250 + 90 = 460 s, with the install and the preflight (~15 s) within
# 8 minutes (docs/device.md); the bench's own sections have budgets inside its deadline (bench/device_step.py).
# On the CPU, loose: the dry run shows that every step runs, on cores others may be using
if [ "$device" = cuda ]; then tests_s=120 bench_s=250 quant_s=90 bench_args=() quant_args=(); else
    tests_s=1200 bench_args=(--rows 1,8 --decode-steps 16 --offload-tokens 512) bench_s=600
    quant_s=200 quant_args=(--decode-steps 8 --prompt-tokens 128); fi

started=$(date +%s)
# before any device time: every module the steps import loads (the image lacks what the wheels do not bring)
{ "$python" -m pytest -q --collect-only -p no:cacheprovider tests/test_cuda.py \
    && "$python" -c 'import sys; sys.path.insert(0, "bench"); import device_step'; } >"$work/preflight.log" 2>&1
preflight_rc=$?
if [ $preflight_rc = 0 ]; then
    timeout "$tests_s" "$python" -m pytest -q -s -p no:cacheprovider tests/test_cuda.py >"$work/tests.log" 2>&1
    tests_rc=$?
    timeout "$bench_s" "$python" bench/device_step.py --device "$device" "${bench_args[@]}" --report "$work/bench.json" \
        --deadline $(( bench_s - 15 )) >"$work/bench.log" 2>&1
    bench_rc=$?
    timeout "$quant_s" "$python" bench/throughput.py --device "$device" --sections device-quant "${quant_args[@]}" \
        --report "$work/quant.json" >"$work/quant.log" 2>&1
    quant_rc=$?
else
    blocker=$(grep -v '^ *$' "$work/preflight.log" | tail -1)
    echo "bench/device.sh: the steps would not start, none was run: ${blocker:-see $report}" >&2
    echo "bench/device.sh: bring what is missing as a wheel (DEVICE_PACKAGES in the Makefile, then 'make device-wheels')" >&2
    tests_rc=skipped bench_rc=skipped quant_rc=skipped
    for step in tests bench quant; do echo "not run: the preflight failed" >"$work/$step.log"; done
fi
{
    echo "# kvbatch device report"
    echo
    echo "- when: $(date -u '+%Y-%m-%d %H:%M UTC'), $(( $(date +%s) - started )) s"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "- device: $device$(command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/, /')"
    echo "- $("$python" -c 'import sys, torch, transformers; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")' 2>&1)"
    echo "- tests/test_cuda.py: exit $tests_rc$([ $tests_rc = 124 ] && echo " (stopped after $tests_s s)"); bench/device_step.py: exit $bench_rc$([ $bench_rc = 124 ] && echo " (stopped after $bench_s s)"); quantized weights: exit $quant_rc$([ $quant_rc = 124 ] && echo " (stopped after $quant_s s)")"
    echo
    if [ $preflight_rc != 0 ]; then
        echo "## preflight (the imports of every step): exit $preflight_rc"
        echo
        echo '```'
        tail -40 "$work/preflight.log"
        echo '```'
        echo
    fi
    echo "## tests/test_cuda.py"
    echo
    echo '```'
    sed -E 's/USDT:.*profiler_(start|stop)//' "$work/tests.log" | grep -v '^$'
    echo '```'
    echo
    echo "## bench/device_step.py --device $device"
    echo
    echo '```'
    sed -E 's/USDT:.*profiler_(start|stop)//' "$work/bench.log" | grep -v -e '^$' -e 'ContinuousBatchingLogger - WARNING'
    echo '```'
    echo
    echo "## bench/throughput.py --sections device-quant (quantized weights)"
    echo
    echo '```'
    sed -E 's/USDT:.*profiler_(start|stop)//' "$work/quant.log" | grep -v -e '^$' -e 'Loading weights' -e 'Warning'
    echo '```'
    if [ -s "$work/bench.json" ]; then
        echo
        echo '```json'
        cat "$work/bench.json"
        echo '```'
    fi
} >"$report"
echo "bench/device.sh: report in $report (preflight exit $preflight_rc, tests exit $tests_rc, bench exit $bench_rc, quantized exit $quant_rc)"
[ $preflight_rc = 0 ] && [ $tests_rc = 0 ] && [ $bench_rc = 0 ] && [ $quant_rc = 0 ]
