#!/usr/bin/env bash
# One lent GPU call, in the order of what it is worth: this tree's decode steps on each
# cache, replayed in CUDA graphs, under the driver's split settings and each of $SPLITS
# (TARGET,MIN pairs), beside an older tree's ($BASE: a folder holding that tree's npattn/,
# carried); the same under kernel switches ($VARIANTS, space-separated NPATTN_GPU_DEFINES
# sets, names joined by commas) and the quantized GPU tests under each; the GPU tests
# selected by $TESTS_K; bench --caches --gpu
# (host included, beside torch); each step's kernels under Nsight Compute; a full profile
# of the int8 step at batch 1 (details, and SASS source counters with
# .ci/ncu_sass_summary.py's summary of them).
# Usage: OUT=dir BASE=.base SPLITS="528,4 ..." VARIANTS=... TESTS_K=... .ci/gpu-ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NPATTN_CACHE_DIR=/tmp/npattn-cubins
python=${PYTHON:-python3}
step() { echo; echo "==== $1 ($(date +%T))"; }
step "tree and base"
PYTHONPATH=$PWD timeout 150 $python .ci/gpu_cache_kernels.py tree ${SPLITS:+--splits 1056,4 $SPLITS} 2>&1 | tee "$OUT/ab.txt"
if [[ -n "${BASE:-}" && -d "$BASE" ]]; then
  PYTHONPATH=$PWD/$BASE timeout 150 $python .ci/gpu_cache_kernels.py base 2>&1 | tee -a "$OUT/ab.txt"
fi
for defines in ${VARIANTS:-}; do
  NPATTN_GPU_DEFINES="${defines//,/ }" PYTHONPATH=$PWD timeout 150 $python .ci/gpu_cache_kernels.py "$defines" 2>&1 | tee -a "$OUT/ab.txt"
done
for defines in ${VARIANTS:-}; do  # each switch's quantized tests (about 35 s each)
  echo "== tests under $defines" | tee -a "$OUT/variant-tests.txt"
  NPATTN_GPU_DEFINES="${defines//,/ }" PYTHONPATH=$PWD timeout 90 $python -m pytest -q -x -p no:randomly tests/test_gpu.py \
    -k "quantized or codes" 2>&1 | tail -3 | tee -a "$OUT/variant-tests.txt"
done
step "tests"
PYTHONPATH=$PWD timeout ${TESTS_SECONDS:-200} $python -m pytest -q -x -p no:randomly tests/test_gpu.py -k "${TESTS_K:-quantized or codes}" \
  2>&1 | tee "$OUT/tests.txt" | tail -5
step "bench caches"
PYTHONPATH=$PWD timeout 120 $python -m npattn bench --caches --gpu --repeats 5 2>&1 | tee "$OUT/caches.txt"
step "ncu"
PYTHONPATH=$PWD timeout 90 ncu --clock-control none --metrics gpu__time_duration.sum --csv -k regex:"forward_tc|combine" \
  $python .ci/gpu_cache_kernels.py tree --once > "$OUT/ncu.csv" 2>&1
grep -E "forward_tc|combine" "$OUT/ncu.csv" | awk -F'","' '{print substr($5, 1, 60), $NF}'
step "profile"
PYTHONPATH=$PWD timeout 120 ncu --clock-control none --set full -k regex:"forward_tc|combine" --launch-skip 2 --launch-count 2 \
  -o /tmp/int8-b1 -f $python .ci/gpu_profile_step.py int8 1 16384 > /tmp/profile.log 2>&1 || tail -5 /tmp/profile.log
ncu -i /tmp/int8-b1.ncu-rep --page source --csv --print-source sass > "$OUT/int8-b1-sass.csv" 2>&1
$python .ci/ncu_sass_summary.py "$OUT/int8-b1-sass.csv" 20 > "$OUT/int8-b1-sass.txt" 2>&1
ncu -i /tmp/int8-b1.ncu-rep --page details > "$OUT/int8-b1.txt" 2>&1
ncu -i /tmp/int8-b1.ncu-rep --page raw 2>&1 | grep -E "^  [a-z]|smsp__pcsamp_warps_issue_stalled" >> "$OUT/int8-b1.txt"
grep -E "^  void|^    Duration|DRAM Throughput" "$OUT/int8-b1.txt" | cut -c1-100
step "done"
