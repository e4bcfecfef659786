#!/usr/bin/env bash
# One call on a lent GPU machine (see README "GPU checks"): the gpu test tier, compute-sanitizer
# memcheck and racecheck over the kernel tier, and the benchmarks (`python -m hcache bench`). Run
# from the repository root:
#   PYTHONPATH=. OUT=/some/dir bash bench/gpu_session.sh
# Everything is logged under $OUT; the last lines printed are a summary.
set -uo pipefail
OUT=${OUT:-/tmp/hcache-gpu}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} HYPOTHESIS_PROFILE=gpu
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -m hcache info > "$OUT/info.txt" 2>&1; info=$?
python3 -m pytest -m gpu -q -p no:cacheprovider > "$OUT/gpu_tier.txt" 2>&1; tier=$?
san() {  # tool, log name
    compute-sanitizer --tool "$1" --error-exitcode 99 --print-limit 20 \
        python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/test_op_*.py \
        > "$OUT/$2" 2>&1
}
HYPOTHESIS_PROFILE=ci san memcheck sanitizer_memcheck.txt; memcheck=$?
HYPOTHESIS_PROFILE=ci san racecheck sanitizer_racecheck.txt; racecheck=$?
python3 -m hcache bench --out "$OUT" > "$OUT/bench.txt" 2>&1; bench=$?
echo "info=$info gpu_tier=$tier memcheck=$memcheck racecheck=$racecheck bench=$bench"
tail -n 3 "$OUT/gpu_tier.txt"
grep -h "ERROR SUMMARY" "$OUT"/sanitizer_*.txt
tail -n 25 "$OUT/bench.txt"
