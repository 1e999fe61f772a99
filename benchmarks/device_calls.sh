#!/usr/bin/env bash
# One long call on the lent GPU machine for the real-checkpoint benchmarks (issue 53): time_to_accuracy.py's runs and
# evaluation, drop_rate.py at the 0.6B shape, each a JOB, run in order until BUDGET seconds from the call's start.
#
#   BUILD=1 JOBS="asyncrl:0:330" BUDGET=585 bash benchmarks/device_calls.sh      # first call: build Gemma, one cold run
#   JOBS="trl:0:220 asyncrl:1:230 trl:1:180" BUDGET=585 bash benchmarks/device_calls.sh
#   JOBS="eval drop" BUDGET=585 bash benchmarks/device_calls.sh
#   JOBS="accept:vlm" BUDGET=585 ACCEPT_STEPS=4 bash benchmarks/device_calls.sh  # acceptance rows, the time left
#   JOBS="conv" BUDGET=585 bash benchmarks/device_calls.sh                         # 2B kernels, fla conv vs reference
#   JOBS="vs:asyncrl:470" BUDGET=590 bash benchmarks/device_calls.sh    # 2B against TRL: one tool a call, cold
#   JOBS="vs:trl:530" ...; JOBS="vs:asyncrl:400:warm" ...                # then TRL cold, asyncrl on its caches
#
# JOB is TOOL:SEED:LIMIT_S (a seed other than 0 runs --warm: the tool's caches from an earlier run of the call's
# machine), `eval` (judge every saved weight set), `drop` (drop_rate.py at 0.6B: a warm-up run of DROP_WARM_UP s,
# then 0% and 70% dropped, DROP_STEPS steps each, the time left split between the two), `conv` (packing.py's 2B
# packed rows profiled with fla's convolution and with the reference, CONV_GROUPS groups), `vs:TOOL:LIMIT[:warm]`
# (benchmarks/vs_trl.py at the Qwen3.5-2B shape, 6 steps: its start-up cold, or warm on the tool's caches from an
# earlier call; the shape is built outside LIMIT, ~1 min the first time; VT_EXTRA: more asyncrl overrides, e.g.
# "logging.profile_steps=[6]", whose table and metrics.jsonl come back) or `accept:ROWS`
# (benchmarks/acceptance.py's rows, ACCEPT_STEPS steps each, default 10, a row's limit the time left). TASK:
# time_to_accuracy.py's task flags (Gemma-3-270M's by default).
# Before it, on the same warm machine (it goes back after ~30 s idle, and /tmp with it): the vLLM kit's piece calls
# into /tmp/carry (with a 23.1 MB tree the kit's 44 MB pieces no longer fit a call: `bash tools/vllm-kit/send.sh
# .vllm-kit-0.33 40000000` cuts 11 pieces of 40 MB into split/sendNN/ and makes extra-split/: install.sh, zstd and
# its libraries, `pieces`) and the checkpoint's piece calls into /tmp/carry-rc (real_checkpoints.py). Each call
# carries [KIT_EXTRA, ".whl", ".whl-trl"] (KIT_EXTRA: that folder, default .vllm-kit-0.33/extra-split) and returns
# one archive, $OUT/results.tgz: a call returns at most 8 files.
# Measured with it: benchmarks/RESULTS.md, sessions 40-41.
set -u
START=$(date +%s)
DEADLINE=$((START + ${BUDGET:-585}))
RESULTS=/tmp/device-results
mkdir -p "$RESULTS/log" "$RESULTS/tta"
pack() {  # whatever ran, the archive of it: a failed job still returns its logs
  for r in /tmp/tta/runs/*/; do
    [ -d "$r" ] || continue
    n=$(basename "$r")
    for f in metrics.jsonl launch.log timeline.json logs/server.log; do
      [ -f "$r/$f" ] && tail -c 400000 "$r/$f" > "$RESULTS/tta/$n-${f//\//-}"
    done
    [ -f "$r/console.err" ] && tail -c 20000 "$r/console.err" > "$RESULTS/tta/$n-console.err"
  done
  [ -d /tmp/acc-out ] && cp -r /tmp/acc-out "$RESULTS/acc"
  for f in /tmp/vt/runs/*-asyncrl/launch.log /tmp/vt/runs/*-asyncrl/logs/server.log /tmp/vt/runs/*.err \
    /tmp/vt/runs/*-asyncrl/metrics.jsonl /tmp/vt/runs/*-asyncrl/profile/*.txt \
    /tmp/vt/runs/*-asyncrl/fla-configs/rank-0/*.json; do
    [ -f "$f" ] && tail -c 400000 "$f" > "$RESULTS/log/vt-$(basename "$(dirname "$f")")-$(basename "$f")"
  done
  # which Triton kernels compiled when (epoch seconds; vs_trl.json's `launched` is the run's start): those written
  # after the warm-up are what the first real step compiled (45 s of session 25's warm step 1, not yet named)
  [ -d /tmp/vt/caches ] && find /tmp/vt/caches -path "*triton*" -name "*.json" -printf "%T@ %p\n" | sort -n \
    > "$RESULTS/log/vt-triton-cache.txt"
  for r in /tmp/drop/drop*/ /tmp/drop/warm_up/; do
    [ -f "$r/metrics.jsonl" ] && cp "$r/metrics.jsonl" "$RESULTS/log/$(basename "$r")-metrics.jsonl"
  done
  tar -C "$RESULTS" -czf "$OUT/results.tgz" .
}
trap pack EXIT
for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
  echo "ending GPU process $pid, left by an earlier call of this session"
  kill "$pid"
done
source "${KIT_EXTRA:-.vllm-kit-0.33/extra-split}/install.sh" > "$RESULTS/log/install.log" 2>&1 \
  || { tail -20 "$RESULTS/log/install.log"; exit 1; }
# with bytecode, as pip installs by default (install.sh compiles the kit's tree): each process of a run imports from it
[ -d /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site \
  .whl/*.whl .whl-trl/*.whl || exit 1
python3 -m compileall -q -j 0 asyncrl benchmarks > /dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
echo "ready after $(($(date +%s) - START)) s; $(grep -h "^vLLM kit: installed\|imported in" "$RESULTS/log/install.log")"
MODEL=/tmp/real-checkpoints/gemma-3-270m
if [ -n "${BUILD:-}" ] && [ ! -f "$MODEL/model.safetensors" ]; then
  python benchmarks/real_checkpoints.py build --from /tmp/carry-rc --out /tmp/real-checkpoints --models gemma3 \
    > "$RESULTS/log/build.log" 2>&1 || { tail -20 "$RESULTS/log/build.log"; exit 1; }
  echo "built after $(($(date +%s) - START)) s"
fi
# shellcheck disable=SC2086  # TASK is several flags
tta() {
  python benchmarks/time_to_accuracy.py --model "$MODEL" --work /tmp/tta --out "$RESULTS/tta" --deadline "$DEADLINE" \
    ${TASK:---operands-high 9 --eval-prompts 40 --lr 5e-6} "$@"
}
for job in ${JOBS:-}; do
  echo "== $job at $(($(date +%s) - START)) s"
  case $job in
    eval) tta --eval > "$RESULTS/log/eval.log" 2>&1; tail -3 "$RESULTS/log/eval.log" ;;
    drop)  # a warm-up run first (vLLM's cold compile, DROP_WARM_UP s), then 0% and 70% warm, the rest split
      left=$((DEADLINE - $(date +%s) - 30 - ${DROP_WARM_UP:-260}))
      python benchmarks/drop_rate.py --shape 0.6b --device cuda --fractions 0,0.7 --steps "${DROP_STEPS:-16}" \
        --warm-up-timeout "${DROP_WARM_UP:-260}" --run-timeout $((left / 2)) --work /tmp/drop --out "$RESULTS/drop" \
        > "$RESULTS/log/drop.log" 2>&1
      tail -3 "$RESULTS/log/drop.log" ;;
    conv)  # issue 57 item 2: a 2B packed step's top kernels, fla's convolution against the reference; the GPU test
      python -m pytest -q -p no:cacheprovider -m gpu tests/packing/test_deltanet.py > "$RESULTS/log/conv-test.log" 2>&1
      tail -1 "$RESULTS/log/conv-test.log"
      for conv in fla reference; do
        mkdir -p "$RESULTS/conv-$conv"
        OUT=$RESULTS/conv-$conv python benchmarks/packing.py --shape qwen3.5-2b --no-compile --budgets 16384 \
          --groups "${CONV_GROUPS:-12}" --exact-attention varlen --profile --conv "$conv" > "$RESULTS/log/conv-$conv.log" 2>&1
        grep -E "^ *16384|total" "$RESULTS/log/conv-$conv.log"
      done ;;
    vs:*)  # issue 57 item 3: cold and warm first step against TRL at the 2B shape
      IFS=: read -r _ tool limit warm <<< "$job"
      python benchmarks/vs_trl.py --shapes qwen3.5-2b --tools "$tool" --steps 6 --work /tmp/vt --out "$RESULTS/vt" \
        --run-timeout "$limit" ${warm:+--warm} ${VT_EXTRA:+--asyncrl-extra $VT_EXTRA} > "$RESULTS/log/vs-$tool.log" 2>&1
      tail -5 "$RESULTS/log/vs-$tool.log" ;;
    accept:*)  # a recipe row builds its shape first (~32 s at 2B), outside its limit
      left=$((DEADLINE - $(date +%s) - 60))
      python benchmarks/acceptance.py --rows "${job#accept:}" --steps "${ACCEPT_STEPS:-10}" --row-timeout "$left" \
        --out /tmp/acc-out --work /tmp/acc > "$RESULTS/log/accept.log" 2>&1
      tail -5 "$RESULTS/log/accept.log" ;;
    *)
      IFS=: read -r tool seed limit <<< "$job"
      warm=()
      [ "$seed" != 0 ] && warm=(--warm)
      tta --tools "$tool" --seeds "$seed" "${warm[@]}" --run-timeout "$limit" > "$RESULTS/log/$tool-$seed.log" 2>&1
      grep -E "^\[time_to_accuracy\]" "$RESULTS/log/$tool-$seed.log" | tail -2 ;;
  esac
done
echo "== done at $(($(date +%s) - START)) s"
