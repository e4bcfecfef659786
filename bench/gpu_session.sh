#!/usr/bin/env bash
# One call on a lent GPU machine (see README "GPU checks"). Run from the repository root:
#   OUT=/some/dir bash bench/gpu_session.sh
# One global deadline (DEADLINE_S, default 420 s) over every stage; each stage has a budget of
# its own and never runs past the deadline. Stages, in order of value:
#   env.txt        nvidia-smi and `python -m hcache info` (every kernel family compiled)
#   gpu_tier.txt   the gpu test tier (pytest-xdist with 8 workers when installed)
#   sanitizer.txt  compute-sanitizer memcheck (CuPy's pool off, so an overrun inside a pooled
#                  block is seen) then initcheck, over the kernel tests; racecheck over the
#                  kernels that use shared memory (lengths, compaction plan)
#   bench.txt      `python -m hcache bench` then `--host`; their reports are the two JSON files
#                  <date>_<gpu>_kernels.json and <date>_<gpu>_host.json
#   suite.txt      the whole test suite with 16 workers (issue 29), in the time left
#   summary.txt    exit codes and the lines worth reading first
# At most 8 files, all in $OUT, each written as its stage runs: a killed session keeps its logs.
set -uo pipefail
OUT=${OUT:-/tmp/hcache-gpu}
DEADLINE_S=${DEADLINE_S:-420}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu}
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # JAX shares the GPU with CuPy (issue 29)
END=$(( $(date +%s) + DEADLINE_S ))
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

left() { echo $(( END - $(date +%s) )); }
budget() {  # a stage's own budget, cut to what is left before the deadline (>= 1 s)
    local want=$1 rest
    rest=$(left)
    [ "$rest" -lt "$want" ] && want=$rest
    [ "$want" -lt 1 ] && want=1
    echo "$want"
}
stage() {  # name, budget, log, command...: runs unless the deadline has passed
    local name=$1 want=$2 log=$3; shift 3
    if [ "$(left)" -le 0 ]; then
        echo "$name=skipped(deadline)" >> "$SUMMARY"; echo "skipped: deadline" >> "$log"
        return 0
    fi
    local t0=$SECONDS
    timeout "$(budget "$want")" "$@" >> "$log" 2>&1
    local rc=$?
    echo "$name=$rc ($(( SECONDS - t0 )) s)" >> "$SUMMARY"
    return 0
}

XDIST=() XDIST16=()
timeout 20 python3 -c "import xdist" >/dev/null 2>&1 && XDIST=(-n 8) XDIST16=(-n 16)
SANITIZER=$(command -v compute-sanitizer \
            || ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer \
                  /usr/local/cuda*/compute-sanitizer/compute-sanitizer 2>/dev/null | head -n 1)

timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv \
    > "$OUT/env.txt" 2>&1
stage info 45 "$OUT/env.txt" python3 -m hcache info
stage gpu_tier 120 "$OUT/gpu_tier.txt" \
    python3 -m pytest -m gpu -q -p no:cacheprovider "${XDIST[@]}"
if [ -n "$SANITIZER" ]; then
    for tool in memcheck initcheck; do
        echo "== $tool" >> "$OUT/sanitizer.txt"
        stage "$tool" 60 "$OUT/sanitizer.txt" env HCACHE_CUPY_POOL=0 HYPOTHESIS_PROFILE=ci \
            "$SANITIZER" --tool "$tool" --error-exitcode 99 --print-limit 20 \
            python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/test_op_*.py
    done
    # racecheck: shared memory only, which the block-wide lengths and compaction-plan kernels use
    echo "== racecheck" >> "$OUT/sanitizer.txt"
    stage racecheck 40 "$OUT/sanitizer.txt" env HYPOTHESIS_PROFILE=ci \
        "$SANITIZER" --tool racecheck --error-exitcode 99 --print-limit 20 \
        python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/test_op_lengths.py \
        tests/test_op_compact.py
else
    echo "compute-sanitizer not found" > "$OUT/sanitizer.txt"
    echo "sanitizer=not-found" >> "$SUMMARY"
fi
stage bench 80 "$OUT/bench.txt" python3 -m hcache bench --out "$OUT"
stage bench_host 50 "$OUT/bench.txt" python3 -m hcache bench --host --out "$OUT"
rm -f "$OUT"/*.png   # the plots, when matplotlib is there: not worth a file of the eight
stage suite 600 "$OUT/suite.txt" python3 -m pytest -q -p no:cacheprovider "${XDIST16[@]}" -x

{
    echo "sanitizer=${SANITIZER:-none}"
    tail -n 3 "$OUT/gpu_tier.txt"
    grep -h "ERROR SUMMARY" "$OUT/sanitizer.txt"
    tail -n 3 "$OUT/suite.txt"
} >> "$SUMMARY" 2>/dev/null
cat "$SUMMARY"
