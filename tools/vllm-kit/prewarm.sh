#!/usr/bin/env bash
# A fresh device machine's compile caches for one recipe row, filled in one call (~390 s at the 2B shape) instead of
# the two a cut cold row takes: the row runs (the trainer's cold eager warm-up: fla's Triton kernels compile and
# autotune, ~225 s) while a second vLLM with the command the row will launch (`asyncrl config --server-command`,
# only its port and a 0.3 memory share changed: neither is in vLLM's compile-cache key) boots cold beside it
# (torch.compile ~23 s, its GDN kernels' "initial profiling/warmup run" ~85 s, graph capture). The row's next run on
# the machine is then a user's second run. Session 18 (this call inline, then the row): the row's vLLM loaded the
# AOT compile from the same cache directory (torch.compile 0.73 s, its profiling run 0.40 s) and passed in 306 s.
#
#   source .vllm-kit-0.33/extra/install.sh; (the .whl install, PYTHONPATH as in the README)
#   bash tools/vllm-kit/prewarm.sh deepmath deepmath qwen3.5-2b          # then the row itself, in the next call
#   bash tools/vllm-kit/prewarm.sh deepmath-4b deepmath_qwen3_4b qwen3-4b
#
# Writes $OUT/prewarm.txt (the row's output), $OUT/prewarm-vllm.log and the row's own acceptance files.
set -uo pipefail
row=${1:?ROW}; recipe=${2:?RECIPE}; shape=${3:?SHAPE}; row_timeout=${4:-330}
python benchmarks/acceptance.py --rows "$row" --row-timeout "$row_timeout" --out "$OUT" --work /tmp/acc \
  > "$OUT/prewarm.txt" 2>&1 &
acceptance=$!
until grep -q "built the" "$OUT/prewarm.txt"; do sleep 2; [ $SECONDS -gt 200 ] && break; done
args="+recipe=$recipe model.name_or_path=/tmp/acc/shapes/$shape data=arithmetic reward=length"
command=$(python -m asyncrl config --server-command $args 2>/dev/null | tail -1 \
  | sed -E 's/--gpu-memory-utilization [0-9.]+/--gpu-memory-utilization 0.3/; s/--port [0-9]+/--port 8011/')
echo "prewarm: at $SECONDS s: $command"
setsid bash -c "$command" > "$OUT/prewarm-vllm.log" 2>&1 &
server=$!
until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health', timeout=2)" 2>/dev/null; do
  sleep 3; [ $SECONDS -gt 470 ] && break
done
echo "prewarm: the second vLLM healthy (or given up) at $SECONDS s"
kill -- -"$server"
wait "$acceptance"
du -sh ~/.cache/vllm ~/.triton "/tmp/torchinductor_$(id -un)"
