#!/usr/bin/env bash
# Prepare vLLM VERSION (0.28.0) with the torch, torchvision, triton and NCCL it pins for an offline install
# on the H200 machine (torch 2.11 / CUDA 13, no network). Run from the project; ~6 minutes on 2 cores.
#   tools/vllm-kit/build.sh 0.28.0
# Output (git-ignored): .vllm-kit/part00..NN (44,000,000 bytes each) and .vllm-kit/extra/ (install script,
# zstd and its libraries, the last piece). See README.md here for what is pruned and why.
# KEEP_ALL_ARCHS=1 keeps every GPU architecture's code (~500 MB more, ~20 pieces).
set -euo pipefail
version=${1:?usage: tools/vllm-kit/build.sh VLLM_VERSION  (e.g. 0.28.0)}
here=$(cd "$(dirname "$0")" && pwd)
top=$(git rev-parse --show-toplevel); cd "$top"
exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"  # a worktree's .git is a file
out=${VLLM_KIT_OUT:-.vllm-kit}  # another folder keeps a kit of an earlier release beside this one
grep -qxF "/$out/" "$exclude" 2>/dev/null || echo "/$out/" >> "$exclude"
deps="$here/deps-${version%.*}.txt"  # per minor release: deps-0.28.txt
[ -f "$deps" ] || { echo "no $deps: list the pure-python dependencies the GPU machine lacks for vLLM $version"; exit 1; }
rm -rf "$out"; mkdir -p "$out/extra" "$out/work/wheels" "$out/work/site" "$out/work/deps"
w=$out/work
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_18_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
fetch() { python3 -m pip download -q --no-deps "${plat[@]}" -d "$1" "$2"; }
pin() { unzip -p "$1" '*.dist-info/METADATA' | sed -n "s/^Requires-Dist: $2[=~]=\([^ ;,]*\).*/\1/p" | head -n 1; }

fetch "$w/wheels" "vllm==$version"
torch=$(pin "$w"/wheels/vllm-*.whl torch); vision=$(pin "$w"/wheels/vllm-*.whl torchvision)
fetch "$w/wheels" "torch==$torch"
triton=$(pin "$w"/wheels/torch-*.whl triton); nccl=$(pin "$w"/wheels/torch-*.whl nvidia-nccl-cu13)
# NCCL is the one NVIDIA library the machine's release (2.28.9) cannot stand in for: libtorch_cuda.so imports
# 8 symbols 2.28.9 lacks (symcheck.py). cuDNN 9.19 and cuSPARSELt 0.8.0 export every symbol torch uses,
# and torch 2.13's CUDA 13.0.3 libraries differ from the machine's 13.0.2 only in cuBLAS, symbol-identical.
fetch "$w/wheels" "torchvision==$vision"; fetch "$w/wheels" "triton==$triton"; fetch "$w/wheels" "nvidia-nccl-cu13==$nccl"
echo "vllm $version, torch $torch, torchvision $vision, triton $triton, nccl $nccl"
for whl in "$w"/wheels/*.whl; do unzip -q -o "$whl" -d "$w/site"; done  # unzip keeps the executables' modes

# Not needed to serve on Hopper: FA2 (vLLM uses FA3 there), Blackwell sources, other Pythons' builds, the
# opt-in Rust frontend (VLLM_USE_RUST_FRONTEND); torch's CMake files (no extension is compiled there);
# Triton's profiler libraries, Blackwell ptxas and test plugins; NCCL's headers; static libraries; debug
# sections and static symbol tables (237 + 44 MB of libtriton.so; the dynamic symbols stay); and GPU code
# for other architectures than sm_90 (keep_arch.py).
s=$w/site
rm -f "$s"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$s"/vllm/vllm-rs
# torch/include stays: Inductor compiles its CPU kernels against it (a CPU scalar in a compiled graph, as under
# LoRA, failed with "torch/csrc/inductor/cpp_prefix.h: No such file or directory" on the H200 without it).
rm -rf "$s"/vllm/third_party/fmha_sm100 "$s"/torch/share "$s"/nvidia/nccl/include
find "$s"/vllm -name '*.cpython-31[0134]-*.so' -delete
rm -rf "$s"/triton/backends/nvidia/lib/cupti "$s"/triton/instrumentation "$s"/triton/FileCheck
rm -f "$s"/triton/backends/nvidia/bin/ptxas-blackwell "$s"/triton/plugins/*TestLib*
find "$s" -name '*.a' -delete
find "$s" -type f \( -name '*.so' -o -name '*.so.*' \) -size +1M -print0 > "$w/libs"
xargs -0 strip --strip-unneeded < "$w/libs"
[ "${KEEP_ALL_ARCHS:-0}" = 1 ] || xargs -0 python3 "$here/keep_arch.py" 90 < "$w/libs"
while read -r spec; do fetch "$w/deps" "$spec"; done < "$deps"
# The wheels are stored uncompressed (same files, same RECORD) so that zstd compresses them with the rest.
python3 - "$w/deps" <<'PY'
import pathlib, sys, zipfile
for wheel in pathlib.Path(sys.argv[1]).glob("*.whl"):
    with zipfile.ZipFile(wheel) as src:
        entries = [(info, src.read(info)) for info in src.infolist()]
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as dst:
        for info, data in entries:
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
PY
du -sh "$s" "$w/deps"
echo "compressing (zstd -12 -T2, a few minutes) ..."
tar -C "$w" -cf - site deps | zstd -12 -T2 -q -o "$w/bundle.tar.zst"
(cd "$out" && split -b 44000000 -d -a 2 work/bundle.tar.zst part)
# The last piece travels with extra/ in the install run (with the repo's 16 MB it stays under 64 MiB).
mv "$(ls "$out"/part* | tail -n 1)" "$out/extra/"
cp /usr/bin/zstd "$out/extra/"
for lib in $(ldd /usr/bin/zstd | awk '/=>/ {print $3}' | grep -v -E 'libc\.so|ld-linux'); do cp -L "$lib" "$out/extra/"; done
cp "$here/install.sh" "$out/extra/"
ls "$out" "$out/extra" | grep -c "^part" > "$out/extra/pieces"
ls -l "$w/bundle.tar.zst"
rm -rf "$w"
ls -l "$out" "$out/extra"
