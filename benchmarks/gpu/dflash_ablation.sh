#!/usr/bin/env bash
# Why DFlash trails EAGLE-3 on SmolLM2-135M (issue 52's second goal), measured on one card: DFlash drafters trained
# online for the same number of steps on one prepared-data directory, one knob changed each (block size, decoder
# layers, hard against soft labels), each run's held-out acceptance by block slot and replayed block tau from its
# final eval; the base run also evaluates along the way (held-out tau against training tokens), and its drafter is
# benched with whole rounds as one CUDA graph and host-driven. After it, both drafters' training rate on this card as
# the epochs after the first run it (benchmarks.train on random features): the training-time comparison. The table
# in $MD is rewritten after each run, so a lease that runs out keeps the finished rows.
#
# Run after the gpu preset (or its prepare alone), in the same lease, reusing its prepared data and cached target:
#   AFTER='bash benchmarks/gpu/dflash_ablation.sh' bash benchmarks/gpu/gpu_preset.sh stage-b bg
#   (PRESET=gpu-dflash EYAS_ARGS='--until prepare' for the prepare alone: both presets prepare alike)
# Variables: DATA (prepared dir, /root/run/prepared), TARGET (/root/stage/smollm2.gguf), ABL (work dir, /root/abl),
# MD (/root/after.md), STEPS (200), EVAL_EVERY (base only, 50), RECIPE (gpu-dflash), VARIANTS (space-separated
# NAME=FLAGS with commas for spaces; default below), RATES (1: time both drafters' cached-epoch training rate after
# the base run; 0: skip), DATA_NOTE (what DATA holds, for the header), BENCH (1: bench the base run's drafter on BENCH_LIMIT (10) held-out ShareGPT prompts
# with its rounds as one CUDA graph each and host-driven, beside plain decoding and prompt lookup; 0: skip), COMMIT
# (recorded in the table's header).
# CPU rehearsal: DATA=... TARGET=... RECIPE=FILE RATES=0 STEPS=2 EVAL_EVERY=1 VARIANTS='base= b8=--block-size,8' bash ...
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
DATA=${DATA:-/root/run/prepared}
TARGET=${TARGET:-/root/stage/smollm2.gguf}
ABL=${ABL:-/root/abl}
MD=${MD:-/root/after.md}
STEPS=${STEPS:-200}
EVAL_EVERY=${EVAL_EVERY:-50}
RECIPE=${RECIPE:-gpu-dflash}
VARIANTS=${VARIANTS:-"base= b8=--block-size,8 hard=--labels,hard L1=--dflash-layers,1 L2=--dflash-layers,2"}
mkdir -p "$ABL" && : > "$ABL/runs.txt" || exit 1
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "not recorded")}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)
cat > "$ABL/head.md" <<HEAD
### DFlash knobs on ${DATA_NOTE:-the gpu preset's prepared data} ($(date -u '+%Y-%m-%d %H:%M') UTC)

- machine: ${gpu:-cpu}; commit $commit
- command: \`eyas train --method dflash --recipe $RECIPE --data $DATA --target $TARGET --steps $STEPS\` with one knob
  changed per row (\`bash benchmarks/gpu/dflash_ablation.sh\`); the base row also evaluates every $EVAL_EVERY steps.
- bench of the base run's drafter: \`eyas bench --drafter $ABL/base --dtype bf16 --compile --prompts sharegpt-heldout
  --limit ${BENCH_LIMIT:-10} --max-turns 1 --max-new-tokens 256\` with \`--graph-round\` and with \`--no-graph-round\`.
- training rates of the epochs after the first: \`python -m benchmarks.train --method M --shapes smollm2 --seqs 2048
  --batch-tokens 32768 --attention flex --compile 1\` (DFlash: block 16, 4 layers, 512 anchors), random features.

HEAD
summarise() { { cat "$ABL/head.md"; python3 "$here/dflash_ablation_table.py" "$ABL"; } > "$MD"; }
rates() {  # both drafters' training rate on this card, as the epochs after the first run it
  for m in eagle3 dflash; do
    timeout 150 python3 -m benchmarks.train --method $m --shapes smollm2 --seqs 2048 --batch-tokens 32768 \
      --attention flex --compile 1 --block 16 --dflash-layers 4 --anchors 512 --no-record --json "$ABL/rate-$m.json" \
      > "$ABL/rate-$m.log" 2>&1
    echo "rate $m: exit $?"; tail -n 4 "$ABL/rate-$m.log"
  done
  summarise
}
for v in $VARIANTS; do
  name=${v%%=*}; flags=${v#*=}; flags=${flags//,/ }
  extra=""; [ "$name" = base ] && extra="--eval-every $EVAL_EVERY"
  start=$(date +%s)
  # shellcheck disable=SC2086  # the flags split on purpose
  python3 -m eyas train --method dflash --recipe "$RECIPE" --data "$DATA" --target "$TARGET" --steps "$STEPS" \
    --out "$ABL/$name" --no-progress $extra $flags > "$ABL/$name.log" 2>&1
  rc=$?
  echo "$name ($flags): exit $rc after $(( $(date +%s) - start )) s"; tail -n 3 "$ABL/$name.log"
  echo "$name|$flags|$rc|$(( $(date +%s) - start ))" >> "$ABL/runs.txt"
  summarise
  if [ "$name" = base ] && [ "${BENCH:-1}" = 1 ]; then  # its rounds host-driven against one CUDA graph each
    for gr in graph-round no-graph-round; do
      timeout 300 python3 -m eyas bench --drafter "$ABL/base" --target "$TARGET" --dtype bf16 --compile \
        --prompts sharegpt-heldout --limit "${BENCH_LIMIT:-10}" --max-turns 1 --max-new-tokens 256 --$gr \
        --json "$ABL/bench-$gr.json" > "$ABL/bench-$gr.log" 2>&1
      echo "bench --$gr: exit $?"; tail -n 8 "$ABL/bench-$gr.log"
    done
    summarise
  fi
  [ "$name" = base ] && [ "${RATES:-1}" = 1 ] && rates
done
cat "$MD"
