#!/bin/bash
# build libmarlin_peer.so on the device: one object per kernel instantiation, compiled in parallel
set -e
cd "$(dirname "$0")"
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
$NVCC --version | tail -2
F="-std=c++17 -O3 --expt-relaxed-constexpr -static-global-template-stub=false -Xcompiler -fPIC -gencode arch=compute_90,code=sm_90 -Isrc -Isrc/libtorch_stable/moe/marlin_moe_wna16 $EXTRA"
R=src/libtorch_stable/moe/marlin_moe_wna16
mkdir -p gen
i=0
grep "^template __global__" $R/sm80_kernel_bfloat16_fe2m1f_bfloat16.cu | while read -r line; do
  printf '#include "kernel.h"\n#include "marlin_template.h"\nnamespace MARLIN_NAMESPACE_NAME {\n%s\n}\n' "$line" > gen/k$i.cu
  i=$((i + 1))
done
pids=()
for f in gen/k*.cu $R/marlin_mm_moe.cu peer_api.cu; do
  $NVCC $F -c $f -o gen/$(basename $f .cu).o & pids+=($!)
done
for p in "${pids[@]}"; do wait $p; done
$NVCC -shared -cudart static gen/*.o -o libmarlin_peer.so
ls -la libmarlin_peer.so
