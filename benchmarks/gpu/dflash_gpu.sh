#!/usr/bin/env bash
# The DFlash GPU checks that need no staged target, in one call on the lent GPU (carry .stage2/w: the pytest wheels):
# the `-m gpu` tests of the DFlash files (tiny random models: flex block mask = dense mask, compiled packed training
# learns, CUDA-graphed decoding = plain greedy and the CPU), then the Kimi-K2.5-shaped DFlash drafter's training
# throughput and peak memory (benchmarks.train, random weights; blocks 8 and 16). Results under $OUT.
#   bash benchmarks/gpu/dflash_gpu.sh      (from the repository root)
set -uo pipefail
OUT=${OUT:-/tmp/dflash-gpu}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .stage2/w/*.whl || exit 1
export PYTHONPATH=src:tests:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"
start=$(date +%s)
timeout ${TESTS_SECONDS:-240} python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_dflash_train.py \
  tests/test_dflash_decode.py > "$OUT/gputests.log" 2>&1
echo "gpu tests: exit $? after $(( $(date +%s) - start )) s"; tail -n 6 "$OUT/gputests.log"
start=$(date +%s)
timeout ${KIMI_SECONDS:-300} python3 -m benchmarks.train --method dflash --block 8,16 --shapes kimi --seqs 4096 \
  --attention flex --compile 1 --steps 3 --md "$OUT/kimi.md" --json "$OUT/kimi.json" > "$OUT/kimi.log" 2>&1
echo "kimi dflash bench: exit $? after $(( $(date +%s) - start )) s"; tail -n 12 "$OUT/kimi.log"
