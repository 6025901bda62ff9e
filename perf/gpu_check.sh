#!/usr/bin/env bash
# The GPU check, for a CUDA machine (e.g. the device tool's H200; about 5 minutes): the kernel and backend
# tests on the GPU, then perf/gpu_bench.py. Uses the machine's own torch/triton/transformers; our packages come
# from the source tree. Results go to $OUT (the device tool's output folder) or perf/out/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/backend:$PWD/kernels:$PWD/client" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 \
       TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT="${OUT:-perf/out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu_info.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)" | tee -a "$OUT/gpu_info.txt"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_attention_backends.py \
    2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 300 python3 perf/gpu_bench.py 2>&1 | tee "$OUT/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
