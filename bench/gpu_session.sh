#!/usr/bin/env bash
# One call on a lent GPU machine (see README "GPU checks"): the gpu test tier, compute-sanitizer
# over the kernel tier (memcheck with CuPy's memory pool off, so an overrun inside what would be a
# pooled allocation is seen; initcheck for reads of memory nothing wrote), and the benchmarks
# (`python -m hcache bench`, then `--host`). Run from the repository root:
#   PYTHONPATH=. OUT=/some/dir bash bench/gpu_session.sh
# Every stage has a time limit; everything is logged under $OUT; the last lines are a summary.
set -uo pipefail
OUT=${OUT:-/tmp/hcache-gpu}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} HYPOTHESIS_PROFILE=gpu
SANITIZER=$(command -v compute-sanitizer \
            || ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer \
                  /usr/local/cuda*/compute-sanitizer/compute-sanitizer 2>/dev/null | head -n 1)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
timeout 300 python3 -m hcache info > "$OUT/info.txt" 2>&1; info=$?
timeout 900 python3 -m pytest -m gpu -q -p no:cacheprovider > "$OUT/gpu_tier.txt" 2>&1; tier=$?
san() {  # tool, log name
    if [ -z "$SANITIZER" ]; then echo "compute-sanitizer not found" > "$OUT/$2"; return 127; fi
    HCACHE_CUPY_POOL=0 HYPOTHESIS_PROFILE=ci timeout 900 "$SANITIZER" --tool "$1" \
        --error-exitcode 99 --print-limit 20 \
        python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/test_op_*.py > "$OUT/$2" 2>&1
}
san memcheck sanitizer_memcheck.txt; memcheck=$?
san initcheck sanitizer_initcheck.txt; initcheck=$?
timeout 900 python3 -m hcache bench --out "$OUT" > "$OUT/bench.txt" 2>&1; bench=$?
timeout 600 python3 -m hcache bench --host --out "$OUT/host" > "$OUT/bench_host.txt" 2>&1
host=$?
echo "sanitizer=${SANITIZER:-none} info=$info gpu_tier=$tier memcheck=$memcheck" \
     "initcheck=$initcheck bench=$bench host=$host"
tail -n 3 "$OUT/gpu_tier.txt"
grep -h "ERROR SUMMARY" "$OUT"/sanitizer_*.txt
tail -n 25 "$OUT/bench.txt"
tail -n 15 "$OUT/bench_host.txt"
