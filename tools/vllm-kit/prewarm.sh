#!/usr/bin/env bash
# A fresh device machine's compile caches for one recipe row, filled in one call (~390 s at the 2B shape) instead of
# the two a cut cold row takes: the row runs (the trainer's cold eager warm-up: fla's Triton kernels compile and
# autotune, ~225 s) while a second vLLM with the command the row will launch (`asyncrl config --server-command`,
# only its port and its memory share changed: neither is in vLLM's compile-cache key) boots cold beside it
# (torch.compile ~23 s, its GDN kernels' "initial profiling/warmup run" ~85 s, graph capture). The row's next run on
# the machine is then a user's second run. Session 18 (this call inline, then the row): the row's vLLM loaded the
# AOT compile from the same cache directory (torch.compile 0.73 s, its profiling run 0.40 s) and passed in 306 s.
# The second vLLM is ended when healthy, or as soon as the row launches its own vLLM (whose share must be free at
# its start), so the row itself may pass in this call given ROW_TIMEOUT.
#
#   source .vllm-kit-0.33/extra/install.sh; (the .whl install, PYTHONPATH as in the README)
#   bash tools/vllm-kit/prewarm.sh deepmath deepmath qwen3.5-2b          # then the row itself, in the next call
#   bash tools/vllm-kit/prewarm.sh deepmath-4b deepmath_qwen3_4b qwen3-4b
#   PREWARM_SHARE=0.2 bash tools/vllm-kit/prewarm.sh vlm shapes qwen3.5-2b 480 --steps 2  # the image row, one call
#
# ROW RECIPE SHAPE [ROW_TIMEOUT [ACCEPTANCE FLAGS...]]: the server command is the recipe's on the shape with
# `data=arithmetic reward=length` (the recipe rows' data), or with the recipe's own data where RECIPE is `shapes`.
# PREWARM_SHARE: the second vLLM's --gpu-memory-utilization (default 0.3; less on an 80 GB card beside a 2B trainer).
# Writes $OUT/prewarm.txt (the row's output), $OUT/prewarm-vllm.log and the row's own acceptance files.
set -uo pipefail
row=${1:?ROW}; recipe=${2:?RECIPE}; shape=${3:?SHAPE}; row_timeout=${4:-330}
shift $(($# < 4 ? $# : 4))
started=$(date +%s)
python benchmarks/acceptance.py --rows "$row" --row-timeout "$row_timeout" --out "$OUT" --work /tmp/acc "$@" \
  > "$OUT/prewarm.txt" 2>&1 &
acceptance=$!
until grep -q "built the\|^\[acceptance\] \$ " "$OUT/prewarm.txt"; do sleep 2; [ $SECONDS -gt 200 ] && break; done
data="data=arithmetic reward=length"
[ "$recipe" = shapes ] && data=""
args="+recipe=$recipe model.name_or_path=/tmp/acc/shapes/$shape $data"
# shellcheck disable=SC2086  # args are several overrides
command=$(python -m asyncrl config --server-command $args 2>/dev/null | tail -1 \
  | sed -E "s/--gpu-memory-utilization [0-9.]+/--gpu-memory-utilization ${PREWARM_SHARE:-0.3}/; s/--port [0-9]+/--port 8011/")
echo "prewarm: at $SECONDS s: $command"
TRITON_CACHE_AUTOTUNING=1 setsid bash -c "$command" > "$OUT/prewarm-vllm.log" 2>&1 &
server=$!
row_launched() {  # the row's own vLLM: its command file is written as it starts
  [ -n "$(find /tmp/acc -path '*/commands/server*.sh' -newermt "@$started" 2>/dev/null | head -1)" ]
}
until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health', timeout=2)" 2>/dev/null; do
  sleep 3
  if row_launched; then echo "prewarm: the row launched its own vLLM at $SECONDS s"; break; fi
  kill -0 "$server" 2>/dev/null || { echo "prewarm: the second vLLM ended by itself at $SECONDS s"; break; }
  [ $SECONDS -gt 470 ] && break
done
echo "prewarm: the second vLLM healthy, ended or given up at $SECONDS s"
kill -- -"$server" 2>/dev/null
wait "$acceptance"
tail -3 "$OUT/prewarm.txt"
du -sh ~/.cache/vllm ~/.triton "/tmp/torchinductor_$(id -un)"
