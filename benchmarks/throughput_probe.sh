#!/usr/bin/env bash
# The gpu preset's throughput bounds on one H200 (issue 33, goal 1), in one background job: the online target
# forward with and without its padding mask, regeneration (the default decode step against the compiled one, and
# twice the rows), and the online training step with its kernel profile. Each script appends its section to
# BENCHMARKS.md next to the scripts' parent (twin_live.sh bg copies them to $WORK/bench: $WORK/BENCHMARKS.md).
#   AFTER=$WORK/bench/throughput_probe.sh bash benchmarks/twin_live.sh bg ...      (after the engine jobs)
#   bash benchmarks/throughput_probe.sh                                            (alone, from the repo root)
set -u
B=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
t() { echo "== $(date +%H:%M:%S) $*"; timeout "${PROBE_LIMIT:-420}" python3 "$@"; echo "== exit $?"; }
t $B/target_forward.py
t $B/regen.py --modes window+compact,compiled --batch 512
t $B/regen.py --modes window+compact --batch 1024 --prompts 2048
t $B/train.py --shapes smollm2 --seqs 2048 --batch-tokens 32768 --ttt-steps 6 --attention flex --compile 1 --online \
  --steps 8 --profile
