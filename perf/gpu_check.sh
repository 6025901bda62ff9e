#!/usr/bin/env bash
# The GPU check, for a CUDA machine (e.g. the device tool's H200; about 7 minutes): the kernel, backend,
# KV-budget, fp8 tensor-core and decode CUDA-graph tests on the GPU, then perf/gpu_bench.py (decode of bf16 with
# graphs and eager, fp8 KV, fp8 W8A8 and int4 AWQ, and a batch-1 step's anatomy),
# then the served benchmark through tritonserver (where
# the machine has the nvidia-pytriton wheel), then (2+ GPUs) perf/tensor_parallel.py over NCCL. Uses the
# machine's own torch/triton/transformers; our packages come from the source tree. Results go to $OUT (the
# device tool's output folder) or perf/out/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/backend:$PWD/kernels:$PWD/client" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 \
       TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT="${OUT:-perf/out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu_info.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)" | tee -a "$OUT/gpu_info.txt"
# the GPU paths only: -k drops the C++ CPU kernels' tests (which would build them here for nothing)
timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 90 -k "not cpu and not avx2 and not avx512" \
    tests/kernels/test_triton_kernels.py tests/kernels/test_lora_kernels.py tests/attention/test_attention_backends.py \
    tests/engine/test_kv_budget.py tests/models/test_fp8_kv_cache.py::test_triton_kernel_and_torch_read_the_fp8_cache_alike \
    tests/kernels/test_int4_kernels.py tests/kernels/test_fp8_weight_kernels.py \
    tests/models/test_fp8_weights_oracle.py::test_on_fp8_tensor_cores_layers_match_the_widening_reference \
    tests/models/test_fp8_weights_oracle.py::test_on_fp8_tensor_cores_teacher_forced_agreement \
    tests/models/test_int4_oracle.py::test_fp32_matches_transformers_on_the_dequantized_twin tests/engine/test_decode_graphs.py \
    2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 270 python3 perf/gpu_bench.py 2>&1 | tee "$OUT/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}
serve_rc=0
if python3 -c "import pytriton" 2>/dev/null; then  # served: a concurrency sweep over gRPC streaming
    timeout 240 python3 perf/serving.py --quick 2>&1 | tee "$OUT/gpu_serving.log"
    serve_rc=${PIPESTATUS[0]}
else
    echo "no nvidia-pytriton on this machine: served benchmark skipped" | tee "$OUT/gpu_serving.log"
fi
tp_rc=0
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then  # tensor parallelism over NCCL: traffic and TP=1 vs TP=2
    timeout 240 python3 perf/tensor_parallel.py --device cuda --tp 2 --size 1b 2>&1 | tee "$OUT/gpu_tp.log"
    tp_rc=${PIPESTATUS[0]}
else
    echo "one GPU: tensor-parallel benchmark skipped" | tee "$OUT/gpu_tp.log"
fi
echo "tests rc=$tests_rc bench rc=$bench_rc serve rc=$serve_rc tp rc=$tp_rc"
exit $(( tests_rc || bench_rc || serve_rc || tp_rc ))
