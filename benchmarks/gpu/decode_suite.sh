#!/usr/bin/env bash
# The decoding measurements of issue 14 in one go, for a GPU lease (e.g. as gpu_preset.sh's AFTER, or alone in the
# background): the -m gpu tests, the gpu recipe's first bench cold and warm (its report has the bf16 agreement),
# host and one-graph chain and tree rounds with the drafter eager and compiled, the runner's compile variants
# (regions, Triton tuning, max-autotune, combo kernels, flex attention; cold and warm caches), batched chains against
# batched plain decoding, regeneration modes.
# Each step appends its table to $MD and has its own time limit, so one failure does not stop the others.
# Order: the -m gpu tests, the bench process cold and warm (start-up share, with lookup's two shapes and gemv plain
# steps), chain/tree round cost against plain steps (with the prefill row), the runner's compile variants (VARIANTS
# picks a subset), batched chains against batched plain, regeneration.
# Output is unbuffered (PYTHONUNBUFFERED), so a poll sees each row as it is printed.
#   bash benchmarks/gpu/decode_suite.sh DRAFTER [TARGET]     (from the repository root or a copy of it, e.g.
#                                                              gpu_preset.sh's /root/work; DRAFTER: an eyas export
#                                                              or train/drafter directory)
set -u
D=${1:?usage: decode_suite.sh DRAFTER [TARGET]}
T=${2:-smollm2-135m}
MD=${MD:-/root/after.md}
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
# SUITE_SECONDS (default 1500): the whole suite's budget, so it ends inside a 30-minute lease. Steps run in the
# order of issue 14's goals; each gets min(its limit, what is left), and one that cannot start is skipped, said.
END=$(( $(date +%s) + ${SUITE_SECONDS:-1500} ))
# STEPS (default all): which steps run, a space-separated subset of: tests bench round variants batch regen;
# VARIANTS: benchmarks.compile_variants --variants (default: all on CUDA)
STEPS=" ${STEPS:-tests bench round variants batch regen} "
on() { [[ "$STEPS" == *" $1 "* ]]; }
step() {
  local limit=$1; shift; local left=$(( END - $(date +%s) ))
  if [ $left -lt 60 ]; then echo "== skipped (suite budget spent): $*"; return; fi
  [ $limit -gt $left ] && limit=$left
  echo "== $(date -u +%H:%M:%S) (limit ${limit} s) $*"; timeout "$limit" "$@" || echo "!! exit $? from: $*"
}
# GPU_TESTS: which -m gpu tests run first (issue 14's done-when), their log in $TESTS_LOG: "all" (388 s in session
# 11; in session 13 one process ran 34 of 35 in its 600 s), or test files; unset: none. With pytest-xdist (in the
# device image) they run in PYTEST_WORKERS (4) processes: the time is inductor compiling on the CPU cores.
if [ -n "${GPU_TESTS:-}" ] && on tests; then
  [ "$GPU_TESTS" = all ] && sel=tests || sel=$GPU_TESTS
  par=(); python3 -c "import xdist" 2>/dev/null && par=(-n "${PYTEST_WORKERS:-4}")
  step $([ "$GPU_TESTS" = all ] && echo 900 || echo 420) python3 -m pytest -v -m gpu $sel "${par[@]}" -p no:cacheprovider --durations=15 > "${TESTS_LOG:-/root/gpu_tests.log}" 2>&1
  grep -A40 "slowest\|short test summary" "${TESTS_LOG:-/root/gpu_tests.log}" | grep -v "^$" | head -60
fi
# the gpu recipe's first bench as one `eyas bench` process, twice: a cold inductor cache, then a warm one (the
# share of a bench process spent decoding, issue 14's start-up goal); its report has bf16 agreement + fp32 check
BENCH=(python3 -m eyas bench --drafter "$D" --target "$T" --prompts sharegpt-heldout --chain 5 --graph-round --limit 30
       --max-turns 1 --max-new-tokens 256 --max-prompt-tokens 1664 --compile)
# BENCH_EXTRA: more bench flags, e.g. --persist-steps (the warm run then loads the cold run's saved steps)
on bench && for run in cold warm; do step 420 "${BENCH[@]}" ${BENCH_EXTRA:-} --json "${BENCH_DIR:-/root}/bench-$run.json"; done
on round && step 600 python3 -m benchmarks.decode --round graph --chain 3,5 --tree --limit 10 --drafter "$D" --target "$T" --compile --md "$MD"
on variants && step 1000 python3 -m benchmarks.compile_variants --target "$T" --variant-timeout 240 ${VARIANTS:+--variants $VARIANTS} --md "$MD"
on batch && step 600 python3 -m benchmarks.decode --batch 1,4,16,64 --chain 3 --limit 64 --max-new-tokens 128 --drafter "$D" \
  --target "$T" --compile --md "$MD"
on regen && step 400 python3 -m benchmarks.regen --modes window+compact,compiled,compiled+regions --md "$MD"
echo "== $(date -u +%H:%M:%S) done"
