#!/bin/bash
# The GPU run (issues 25 and 35), on a CUDA machine from the repo root. .whl/ holds DeepSpeed's
# source distribution and wheels of hjson, pydantic (+ pydantic-core, annotated-types,
# typing-inspection) for the machine's Python (docs/benchmarks/gpu.md). Then: DeepSpeed from its
# source distribution, its FusedAdam and quantizer kernels built while the quantizer's GPU tests
# run, `ds-ext bench quant --device cuda`, `ds-ext bench tiled_step --device cuda`, the rest of
# `pytest -m gpu`, the shared-GPU probe on gloo. Everything lands in $OUT as it is made.
# `run.sh quant`: the quantizer alone (its GPU tests, DeepSpeed's quantizer kernels, the bench with
# a launch-geometry sweep).
set -u
STAGE=${1:-all}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
t0=$(date +%s)
stamp() { echo "== $1 at $(( $(date +%s) - t0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v "^WARNING: Running pip" | tail -3
tar xzf .whl/deepspeed-0.19.8.tar.gz -C /tmp
(cd /tmp/deepspeed-0.19.8 && DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . 2>&1 | grep -v "^WARNING: Running pip" | tail -5)
export PYTHONPATH=/tmp/site:$PWD
stamp installed
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import sys, torch, deepspeed, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'deepspeed', deepspeed.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"; nvcc --version | tail -1; git log -1 --format='commit %H' 2>/dev/null; } 2>&1 | tee $OUT/environment.txt
OPS="QuantizerBuilder().load()"; [ "$STAGE" = all ] && OPS="FusedAdamBuilder().load(); $OPS"
(timeout 300 python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder, QuantizerBuilder; $OPS; print('ops built')" > $OUT/ops_build.log 2>&1) &
ops=$!
P="python3 -m pytest -m gpu -p no:cacheprovider -q -rA --timeout 200"
timeout 150 $P tests/test_gpu.py -k quantizer 2>&1 | tee $OUT/pytest_gpu.log | grep -v "^PASSED\|WARNING" | tail -30
stamp quantizer-tests
wait $ops; tail -3 $OUT/ops_build.log
stamp ops
bench() { timeout "$1" python3 -c "import sys; from ds_ext.cli import main; sys.exit(main(sys.argv[1:]))" bench "${@:2}" 2>&1 | grep -v "WARNING\|Warning\|warn(" | tee -a $OUT/bench.log | tail -14; }
bench 200 quant --device cuda --out $OUT/bench_quant_cuda.json --geometry 2048:4 8192:4 4096:8 8192:8 16384:8
stamp bench-quant
[ "$STAGE" = quant ] && exit 0
bench 200 tiled_step --device cuda --out $OUT/bench_tiled_step_cuda.json
stamp bench-tiled-step
timeout 200 $P tests/test_gpu.py tests/test_tiled_optimizer.py -k "not quantizer" 2>&1 | tee -a $OUT/pytest_gpu.log | grep -v "^PASSED\|WARNING" | tail -30
stamp pytest
DS_EXT_SHARED_GPU_BACKEND=gloo timeout 120 $P tests/test_gpu_shared.py > $OUT/shared_gloo.log 2>&1; echo "shared gloo rc=$?"; grep -v WARNING $OUT/shared_gloo.log | tail -5
stamp shared
