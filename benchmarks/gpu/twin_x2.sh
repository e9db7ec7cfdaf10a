#!/usr/bin/env bash
# Issue 32 on 2 GPUs (kind nvidia-h200-x2), the DeepSeek-V3 twin in bf16: NOT YET RUN on the device.
# One background job runs these units in order (the most valuable first: a lease that runs out keeps what finished):
#   train2-fsdp    torchrun, 2 ranks, FSDP2: the Kimi-shaped drafter (benchmarks.train --shapes kimi) at 2048 and
#                  8192 tokens; runs while the engine wheels are still being carried (the engines wait for install)
#   sglang-tp2     SGLang 0.5.14 --tp-size 2:                   launch-args -> server -> capture (served check on) ->
#   sglang-ep2     ... --tp-size 2 --ep-size 2                  crosscheck against in-process capture; the same
#   sglang-dp2     ... --tp-size 2 --dp-size 2 --enable-dp-attention (0.5.14's spelling; every sample routed to
#                  one DP group, each group writing its own store rank)
#   vllm-tp2       vLLM 0.25.0 --tensor-parallel-size 2:       the same
#   sglang-serve2  the exported twin drafter (.stage-twin/drafter, placed by `stage`) served at TP 2 with EAGLE-3
#   vllm-serve2    beside a plain TP-2 server: `eyas bench --engine` (tau, speedup, greedy equality); vLLM eager
#   train2-ddp     the same training under DDP
#   train1         the same training on one GPU of this machine: the scaling baseline (else the recorded one)
# Each engine unit is `twin_live.sh job ENGINE` with RUN (its results directory), LA_PAR (launch-args' sizes) and
# SRV_PAR (the serve phase's server sizes); see twin_live.sh for the phases. UNITS="..." picks and orders units.
#
# Plan (each device call is `run` with kind nvidia-h200-x2 and the carry shown, back to back within the 30 s idle
# release; every carry <= 64 MiB; minutes are estimates from the 1-GPU runs, not measured on 2 GPUs):
#   here, once:  bash benchmarks/gpu/engines_live.sh split   (.stage-engines/: sglang part-00..04, vllm part-00..05)
#                bash benchmarks/gpu/twin_live.sh prep       (.stage-twin/, about 29 MB; keep .stage-twin/drafter)
#   call 1   carry .stage-twin                          bash benchmarks/gpu/twin_x2.sh stage && bash benchmarks/gpu/twin_x2.sh bg
#                                                       (~1.5 min with the machine's start; train2-fsdp starts)
#   calls 2-5  carry .stage-engines/sglang/part-0N      STAGE_MARK=/root/stage/twin/config.json bash
#                                                       benchmarks/gpu/engines_live.sh stage sglang 0N  (N = 0..3)
#   call 6   carry .stage-engines/sglang/part-04 and .stage-engines/sglang/SHA256SUMS
#                                                       STAGE_MARK=... bash benchmarks/gpu/engines_live.sh install sglang
#   calls 7-11 carry .stage-engines/vllm/part-0N        STAGE_MARK=... bash benchmarks/gpu/engines_live.sh stage vllm 0N
#   call 12  carry .stage-engines/vllm/part-05 and .stage-engines/vllm/SHA256SUMS
#                                                       STAGE_MARK=... bash benchmarks/gpu/engines_live.sh install vllm
#            (calls 2-12: ~5 min; train2-fsdp ~5 min meanwhile, capped by TRAIN_LIMIT)
#   calls    OUT=$OUT bash benchmarks/gpu/twin_x2.sh poll 540     (each ~9 min; results in x2-results.tgz)
#   Expected job: train2-fsdp 5, sglang-tp2/ep2/dp2 2.5 each, vllm-tp2 4, sglang-serve2 3, vllm-serve2 4, train2-ddp 4,
#   train1 4 minutes: about 32 minutes from call 1, so the last units are the ones a 30-minute lease drops.
#   A replaced machine is detected (exit 3: stage again from call 1).
# Rehearsal on the CPU machine (no engine installed: servers die at once and say why; training runs on gloo):
#   STAGE=/tmp/rx/stage WORK=/tmp/rx/work SITE_ROOT=/tmp/rx EYAS_CACHE=~/.cache/eyas TRAIN_DEVICE=cpu \
#     TRAIN_ARGS="--shapes tiny --seqs 128 --steps 1 --attention dense --compile 0" bash benchmarks/gpu/twin_x2.sh stage,
#   then touch /tmp/rx/site-{sglang,vllm}/.installed, `... bash benchmarks/gpu/twin_x2.sh bg`, `OUT=/tmp/rx/out ... poll 600`.
set -uo pipefail
cmd=${1:?usage: twin_x2.sh stage|bg|poll S|run}
HERE=$(cd "$(dirname "$0")" && pwd)
STAGE=${STAGE:-/root/stage}
WORK=${WORK:-/root/twin}                        # twin_live.sh's: `stage` puts the drafter in $WORK/drafter
export STAGE WORK NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
UNITS=${UNITS:-"train2-fsdp sglang-tp2 sglang-ep2 sglang-dp2 vllm-tp2 sglang-serve2 vllm-serve2 train2-ddp train1"}
TRAIN_ARGS=${TRAIN_ARGS:-"--shapes kimi --seqs 2048,8192 --attention flex --compile 1"}
TRAIN_DEVICE=${TRAIN_DEVICE:-cuda}
TRAIN_LIMIT=${TRAIN_LIMIT:-420}                 # seconds per training unit
# The 1-GPU rows this machine's scaling falls back to when train1 did not run (BENCHMARKS.md, "Kimi-K2.5-shaped drafter
# training throughput", 2026-12-02, one H200, same command without torchrun): tokens/s per row length
RECORDED_1GPU=${RECORDED_1GPU:-"2048:7728 8192:7941"}

case $cmd in
stage)  # device: the twin, its drafter, prepared data and prompts (twin_live.sh's stage)
  bash "$HERE/twin_live.sh" stage; exit $? ;;
bg)
  [ -f $STAGE/twin/config.json ] || { echo "machine was replaced (no $STAGE/twin): stage again"; exit 3; }
  mkdir -p $WORK && rm -f $WORK/x2.done $WORK/x2.log $WORK/units.txt && rm -rf $WORK/src $WORK/benchmarks &&
    cp -r src $WORK/src && cp -r benchmarks $WORK/benchmarks && cp benchmarks/gpu/twin_live.sh $WORK/job.sh || exit 1
  setsid nohup bash -c "bash $WORK/benchmarks/gpu/twin_x2.sh run > $WORK/x2.log 2>&1; echo \$? > $WORK/x2.done" \
    > /dev/null 2>&1 < /dev/null &
  sleep 5; tail -n 5 $WORK/x2.log; echo "started: $UNITS"; exit 0 ;;
poll)
  end=$(( $(date +%s) + ${2:-540} ))
  [ -f $WORK/job.sh ] || { echo "machine was replaced (no job under $WORK): nothing to wait for, stage again"; exit 3; }
  while [ ! -f $WORK/x2.done ] && [ $(date +%s) -lt $end ]; do sleep 5; done
  [ -f $WORK/x2.done ] && echo "job finished: exit $(cat $WORK/x2.done)" || echo "job still running"
  tail -n ${LINES_SHOWN:-40} $WORK/x2.log
  [ -f $WORK/units.txt ] && { echo "units (name exit seconds):"; cat $WORK/units.txt; }
  [ -f $WORK/train-scaling.txt ] && cat $WORK/train-scaling.txt
  if [ -n "${OUT:-}" ]; then
    (cd $WORK && tar czf $OUT/x2-results.tgz --ignore-failed-read x2.log units.txt train*.log train*.json \
      train-scaling.txt $(for u in $UNITS; do [ -d $u ] && echo $u/*.json $u/*.txt $u/*.log; done) 2>/dev/null)
    ls -la $OUT
  fi
  [ -f $WORK/x2.done ]; exit $? ;;
run) ;;                                          # below: the background job, started by bg
*) echo "unknown command $cmd"; exit 2 ;;
esac

# ---------------------------------------------------------------- the job (device, background)
say() { echo "[$(date +%H:%M:%S)] $*"; }
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader 2>/dev/null || say "no nvidia-smi"
export PYTHONPATH=$WORK/src PYTHONUNBUFFERED=1
train() {  # $1: unit name, $2: ranks, $3: wrap (fsdp | ddp | ''): benchmarks.train, its rows in $WORK/$1.json
  # (run in $WORK: python -m imports the job's copy of the benchmarks package from the current directory)
  local py=(python3 -m benchmarks.train)
  [ "$2" -gt 1 ] && py=(python3 -m torch.distributed.run --standalone --nproc_per_node $2 -m benchmarks.train)
  [ "$2" = 1 ] && [ $TRAIN_DEVICE = cuda ] && export CUDA_VISIBLE_DEVICES=0
  local wrap=(); [ "$3" = fsdp ] && wrap=(--fsdp)                     # DDP is train.py's default under torchrun
  (cd $WORK && timeout $TRAIN_LIMIT "${py[@]}" --device $TRAIN_DEVICE $TRAIN_ARGS "${wrap[@]}" --no-record \
    --json $WORK/$1.json) > $WORK/$1.log 2>&1; local rc=$?
  unset CUDA_VISIBLE_DEVICES
  grep -E "^\|" $WORK/$1.log | tail -n 4
  return $rc
}
engine() {  # $1: unit, $2: engine, $3: phases, $4: launch-args sizes, $5: server sizes (serve phase)
  local p=PHASES_${2^^}
  env RUN=$1 LA_PAR="$4" SRV_PAR="$5" $p="$3" bash $WORK/job.sh job $2 > $WORK/$1.log 2>&1; local rc=$?
  tail -n 25 $WORK/$1.log
  [ $rc = 0 ] && awk '$2 != 0 {bad = 1} END {exit bad || NR == 0}' $WORK/$1/phases.txt 2>/dev/null   # every phase 0
}
scaling() {  # tokens/s of the 2-rank rows against train1's (or the recorded one-GPU rows), and FSDP2's peak memory
  python3 - $WORK "$RECORDED_1GPU" <<'PY' | tee $WORK/train-scaling.txt
import json, math, sys
from pathlib import Path
w, rec = Path(sys.argv[1]), dict(x.split(":") for x in sys.argv[2].split())
def rows(name):
    p = w / f"{name}.json"
    return {r["seq"]: r for r in json.loads(p.read_text())["rows"] if "tok_s" in r} if p.exists() else {}
one = rows("train1")
base = {s: (r["tok_s"], "train1 (this machine)") for s, r in one.items()} or \
       {int(s): (float(v), "recorded 2026-12-02 (another H200)") for s, v in rec.items()}
print("| run | seq | tokens/s all ranks | 1-GPU tokens/s | scaling (goal >= 1.8x) | peak GiB / rank | param MiB / rank |")
print("|---|---|---|---|---|---|---|")
for name in ("train2-fsdp", "train2-ddp"):
    for s, r in sorted(rows(name).items()):
        tot = r["tok_s"] * 2
        b, where = base.get(s, (math.nan, "none"))
        print(f"| {name} | {s} | {tot:,.0f} | {b:,.0f} ({where}) | {tot / b:.2f}x | {r['peak_gib']:.1f} | "
              f"{r['param_mib_rank']:,.1f} |")
PY
}
unit() {  # one unit, timed, its exit status in units.txt
  local t=$(date +%s) rc
  say "== $1"
  case $1 in
    train2-fsdp)   train $1 2 fsdp ;;
    train2-ddp)    train $1 2 ddp ;;
    train1)        train $1 1 "" ;;
    sglang-tp2)    engine $1 sglang capture "--tp 2" "" ;;
    sglang-ep2)    engine $1 sglang capture "--tp 2 --ep 2" "" ;;
    sglang-dp2)    engine $1 sglang capture "--tp 2 --attn-dp 2" "" ;;
    vllm-tp2)      engine $1 vllm capture "--tp 2" "" ;;
    sglang-serve2) engine $1 sglang "drafter serve" "" "--tp-size 2" ;;     # drafter: skipped when staged
    vllm-serve2)   engine $1 vllm "drafter serve" "" "--tensor-parallel-size 2" ;;
    *) say "unknown unit $1"; false ;;
  esac
  rc=$?
  say "== $1: exit $rc in $(( $(date +%s) - t )) s"; echo "$1 $rc $(( $(date +%s) - t ))" >> $WORK/units.txt
  case $1 in train*) scaling > /dev/null 2>&1 ;; esac
}
export LOCAL_REGEN=${LOCAL_REGEN-1}            # a drafter missing from the stage is trained in process, not served
export VLLM_EAGER=${VLLM_EAGER-1}              # vLLM's serve servers eager: a shorter start (the twin's speed says little)
for u in $UNITS; do unit $u; done
scaling
say "units: $(tr '\n' ';' < $WORK/units.txt)"
exit 0
