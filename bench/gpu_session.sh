#!/usr/bin/env bash
# One call on a lent GPU machine (see README "GPU checks"). Run from the repository root:
#   OUT=/some/dir bash bench/gpu_session.sh
# One global deadline (DEADLINE_S, default 480 s) over every stage; each stage has a budget of
# its own and never runs past the deadline. Stages, in order of value:
#   summary.txt    nvidia-smi, every stage's exit code and seconds, then the lines worth reading
#   bench.txt      `python -m hcache info` (every kernel family compiled, registers per thread),
#                  then `python -m hcache bench --quick`, `--calls` and `--host --quick`; their
#                  reports are the three JSON files <date>_<gpu>_{kernels,calls,host}_quick.json
#   gpu_tier.txt   the gpu test tier (pytest-xdist with 8 workers when installed)
#   sanitizer.txt  compute-sanitizer memcheck (CuPy's pool off, so an overrun inside a pooled
#                  block is seen) then initcheck, over the kernel tests; racecheck over the
#                  kernels that use shared memory (lengths, compaction plan)
#   suite.txt      the whole test suite with 12 workers (issue 29), beside the sanitizers
#   (probe)        into bench.txt: Nsight Compute's device time of each decode write launch
#                  (bench/probe_decode.py), free of host gaps
#   ab.txt         the serving loop's in-process A/B against a carried .ab/hcache_base, at
#                  pool x4 against x1, and the block-16 step against its floor (bench/ab/)
# The benches run alone (their timings); the sanitizers (one process) and the suite overlap.
# ONLY="stage ..." runs those stages alone (a follow-up call); PROFILE_HOST=1 runs the host
# bench under cProfile into host.prof.
# At most 8 files, all in $OUT, each written as its stage runs: a killed session keeps its logs.
set -uo pipefail
OUT=${OUT:-/tmp/hcache-gpu}
DEADLINE_S=${DEADLINE_S:-480}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu}
export PYTHONUNBUFFERED=1
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
ONLY=${ONLY:-}
stage() {  # name, budget, log, command...: runs unless the deadline has passed
    local name=$1 want=$2 log=$3; shift 3
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then
        return 0
    fi
    if [ "$(left)" -le 0 ]; then
        echo "$name=skipped(deadline)" >> "$SUMMARY"; echo "skipped: deadline" >> "$log"
        return 0
    fi
    local t0=$SECONDS
    echo "== $name" >> "$log"
    timeout -s INT -k 15 "$(budget "$want")" "$@" >> "$log" 2>&1
    local rc=$?
    echo "$name=$rc ($(( SECONDS - t0 )) s)" >> "$SUMMARY"
    rm -f "$OUT"/*.png   # the benches' plots, when matplotlib is there: not worth a file
    return 0
}

XDIST=() XDIST12=()
timeout 20 python3 -c "import xdist" >/dev/null 2>&1 && XDIST=(-n 8) XDIST12=(-n 12)
SANITIZER=$(command -v compute-sanitizer \
            || ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer \
                  /usr/local/cuda*/compute-sanitizer/compute-sanitizer 2>/dev/null | head -n 1)

timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv \
    >> "$SUMMARY" 2>&1
stage info 60 "$OUT/bench.txt" python3 -m hcache info
stage gpu_tier 90 "$OUT/gpu_tier.txt" \
    python3 -m pytest -m gpu -q -p no:cacheprovider -rfE "${XDIST[@]}"
stage bench 110 "$OUT/bench.txt" python3 -m hcache bench --quick --out "$OUT"
stage bench_calls 50 "$OUT/bench.txt" python3 -m hcache bench --calls --out "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
if [ -n "$NCU" ]; then
    stage probe 60 "$OUT/bench.txt" "$NCU" --kernel-name regex:hc_kv_write \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv \
        python3 bench/probe_decode.py
else
    stage probe 30 "$OUT/bench.txt" python3 bench/probe_decode.py
fi
# ab.txt: the in-process A/B of the serving loop (bench/ab/serving_inprocess.py) against an older
# hcache carried as .ab/hcache_base (see that script), on the GPU machine's quiet host CPU
if [ -d .ab/hcache_base ]; then
    for case in "16 1 200" "256 1 200"; do
        stage ab 60 "$OUT/ab.txt" env HCACHE_BASE=.ab python3 bench/ab/serving_inprocess.py $case
    done
fi
for block in 16 256; do     # and the pool's size: x4 against x1 of this checkout, interleaved
    stage ab 60 "$OUT/ab.txt" python3 bench/ab/pool_scale_inprocess.py $block 4 150
done
# and the floor: an idealised block-16 step against the real one (docs/design.md §8)
stage ab 30 "$OUT/ab.txt" python3 bench/ab/decode_floor_inprocess.py 300
HOST=(python3 -m hcache bench --host --quick --out "$OUT")
[ "${PROFILE_HOST:-0}" = 1 ] && HOST=(python3 -m cProfile -o "$OUT/host.prof" -m hcache bench \
                                     --host --quick --out "$OUT")
stage bench_host 50 "$OUT/bench.txt" "${HOST[@]}"

sanitize() {
    for tool in memcheck initcheck; do
        stage "$tool" 100 "$OUT/sanitizer.txt" env HCACHE_CUPY_POOL=0 HYPOTHESIS_PROFILE=ci \
            "$SANITIZER" --tool "$tool" --error-exitcode 99 --print-limit 20 \
            python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/test_op_*.py
    done
    # racecheck: shared memory only, which the block-wide lengths and compaction-plan kernels use
    stage racecheck 40 "$OUT/sanitizer.txt" env HYPOTHESIS_PROFILE=ci \
        "$SANITIZER" --tool racecheck --error-exitcode 99 --print-limit 20 \
        python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/test_op_lengths.py \
        tests/test_op_compact.py
}
if [ -n "$ONLY" ] && [[ " $ONLY " != *" memcheck "* ]]; then
    SAN_PID=
elif [ -n "$SANITIZER" ]; then
    sanitize &
    SAN_PID=$!
else
    echo "compute-sanitizer not found" > "$OUT/sanitizer.txt"
    echo "sanitizer=not-found" >> "$SUMMARY"
    SAN_PID=
fi
stage suite 600 "$OUT/suite.txt" python3 -m pytest -q -p no:cacheprovider -rfE "${XDIST12[@]}"
[ -n "$SAN_PID" ] && wait "$SAN_PID"

{
    echo "sanitizer=${SANITIZER:-none}"
    tail -n 3 "$OUT/gpu_tier.txt"
    grep -h "ERROR SUMMARY" "$OUT/sanitizer.txt"
    tail -n 3 "$OUT/suite.txt"
} >> "$SUMMARY" 2>/dev/null
cat "$SUMMARY"
