#!/usr/bin/env bash
# On the GPU machine, once earlier runs (while the machine stayed up) have copied part00..partNN into
# /tmp/carry (the last, small piece may come in extra/): install vLLM with its torch, triton, torchvision and
# NCCL into /tmp/vk, and set the environment to use it. Source it:  source .vllm-kit/extra/install.sh || exit 1
# A second source while the machine stays up only sets the environment (the import check runs once too).
# VLLM_KIT_PREFIX and VLLM_KIT_CARRY change the two folders (the dry run on a CPU machine uses them).
extra=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prefix=${VLLM_KIT_PREFIX:-/tmp/vk}; carry=${VLLM_KIT_CARRY:-/tmp/carry}
export PATH="$extra:$PATH"
if [ ! -f "$prefix/installed" ]; then
  pieces=() missing=()
  for i in $(seq -f %02g 0 $(($(cat "$extra/pieces") - 1))); do
    if [ -f "$carry/part$i" ]; then pieces+=("$carry/part$i"); elif [ -f "$extra/part$i" ]; then pieces+=("$extra/part$i")
    else missing+=("part$i"); fi
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "vLLM kit: ${missing[*]} missing from $carry (did the machine stay up between the piece runs?)"
    return 1 2>/dev/null || exit 1
  fi
  started=$SECONDS
  rm -rf "$prefix" && mkdir -p "$prefix" \
    && cat "${pieces[@]}" | LD_LIBRARY_PATH="$extra" zstd -d -q | tar -C "$prefix" -xf - \
    && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$prefix/site" \
         "$prefix"/deps/*.whl \
    && rm -rf "$prefix/deps" \
    || { echo "vLLM kit: install into $prefix failed (see above)"; return 1 2>/dev/null || exit 1; }
  # The tree comes from unpacked wheels, with no bytecode: where PYTHONDONTWRITEBYTECODE is set, every process
  # would compile torch's and vLLM's sources again at its import (a vLLM server starts ten such processes), as no
  # pip-installed copy does. Compiled once here, on every core; a file that is not Python 3 is skipped.
  compiled=$SECONDS
  python3 -m compileall -q -j 0 "$prefix/site" > /dev/null 2>&1
  touch "$prefix/installed"
  echo "vLLM kit: installed into $prefix in $((SECONDS - started)) s ($((SECONDS - compiled)) s of it byte-compiling;" \
    "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset})"
fi
export PYTHONPATH="$prefix/site:${PYTHONPATH:-}"
# torch 2.13 loads NCCL 2.29 from $prefix/site/nvidia/nccl/lib through its RPATH; vLLM's pynccl opens it by path.
export VLLM_NCCL_SO_PATH="$prefix/site/nvidia/nccl/lib/libnccl.so.2"
# torch 2.13 was built against cuDNN 9.20 and refuses the machine's 9.19 at first use, though 9.19 exports every
# symbol torch imports (symcheck.py); serving text models does not use cuDNN.
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
# flashinfer is not carried: vLLM's sampler would import it.
export VLLM_USE_FLASHINFER_SAMPLER=0
# The ipc weight-transfer backend sends pickled CUDA IPC handles over HTTP.
export VLLM_ALLOW_INSECURE_SERIALIZATION=1
# The import check once per machine (its time: vLLM's import, from bytecode); a later source only sets the environment.
if [ ! -f "$prefix/checked" ]; then
  python3 -c "import time; started = time.perf_counter()
import torch, vllm, vllm.entrypoints.openai.api_server as _
print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      'nccl', torch.cuda.nccl.version(), 'ready; imported in %.1f s' % (time.perf_counter() - started))" \
    || { echo "vLLM kit: import failed (above)"; return 1 2>/dev/null || exit 1; }
  touch "$prefix/checked"
fi
