#!/bin/bash
# The GPU run (issue 25), on a CUDA machine from the repo root. .whl/ holds DeepSpeed's source
# distribution and wheels of hjson, pydantic (+ pydantic-core, annotated-types, typing-inspection)
# for the machine's Python (README, "The GPU path"). Then: DeepSpeed from its source distribution,
# pytest -m gpu, the shared-GPU probe per backend, ds-ext bench quant --device cuda.
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
STAGE=${1:-all}
t0=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - t0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v "^WARNING: Running pip" | tail -3
tar xzf .whl/deepspeed-0.19.8.tar.gz -C /tmp
(cd /tmp/deepspeed-0.19.8 && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . 2>&1 | grep -v "^WARNING: Running pip" | tail -5)
export PYTHONPATH=/tmp/site:$PWD
stamp installed
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import sys, torch, deepspeed, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'deepspeed', deepspeed.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"; nvcc --version | tail -1; } 2>&1 | tee $OUT/environment.txt
timeout 300 python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder, QuantizerBuilder; FusedAdamBuilder().load(); QuantizerBuilder().load(); print('ops built')" > $OUT/ops_build.log 2>&1; tail -5 $OUT/ops_build.log
stamp ops
if [ "$STAGE" = all ] || [ "$STAGE" = tests ]; then
  timeout 330 python3 -m pytest -m gpu -p no:cacheprovider -q -rA --timeout 200 tests/test_gpu.py tests/test_tiled_optimizer.py 2>&1 | tee $OUT/pytest_gpu.log | grep -v "^PASSED\|WARNING" | tail -60
  stamp pytest
  for b in ${SHARED:-gloo nccl}; do
    DS_EXT_SHARED_GPU_BACKEND=$b timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -q -rA --timeout 140 tests/test_gpu_shared.py 2>&1 > $OUT/shared_$b.log; echo "shared $b rc=$?"; grep -v WARNING $OUT/shared_$b.log | tail -25
  done
  stamp shared
fi
if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
  timeout 200 python3 -c "import sys; from ds_ext.cli import main; sys.exit(main(['bench', 'quant', '--device', 'cuda', '--out', '$OUT/bench_quant_cuda.json']))" 2>&1 | grep -v WARNING | tee $OUT/bench_quant.log | tail -8
  stamp bench
fi
