# Sourced by examples/megatron_deepspeed_ted.sh and megatron_deepspeed_zero_topo.sh: the environment
# the client runs in and the tiny dense GPT both train (later flags on the command line win).
# needs (examples/megatron_deepspeed_env.sh builds them and prints the exports; see also
# ../shared/clients/README.md): MDS = a copy of the client (its data helpers compile into its tree),
# DS0196 = deepspeed 0.19.6 (DS_BUILD_OPS=0 pip install --no-build-isolation --target DIR), EXTRA = nltk
# + pybind11 + an import-only torchvision stand-in, DATA = a NullTokenizer dataset from its
# tools/preprocess_data.py (--tokenizer-type NullTokenizer --vocab-size 512 --append-eod).
: "${MDS:?copy of megatron-deepspeed}" "${DS0196:?deepspeed 0.19.6 target dir}" "${EXTRA:?extra site dirs}" "${DATA:?data prefix}"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mds_env=(PYTHONPATH="$DS0196:$EXTRA:$repo:$MDS" OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu CUDA_DEVICE_MAX_CONNECTIONS=1)
mds_gpt=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64
  --micro-batch-size 1 --train-iters 10 --lr 1e-3 --min-lr 1e-4 --lr-decay-style constant
  --data-path "$DATA" --tokenizer-type NullTokenizer --vocab-size 512 --split 98,2,0
  --deepspeed --distributed-backend gloo
  --log-interval 1 --eval-interval 1000 --eval-iters 0 --seed 1234
  --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-gradient-accumulation-fusion
  --attention-dropout 0 --hidden-dropout 0)
# PP unset: --no-pipeline-parallel (a plain GPTModel); PP=N: the client's default path, GPTModelPipe on
# DeepSpeed's PipelineEngine with N stages (N = 1 included)
if [ -n "${PP:-}" ]; then mds_gpt+=(--pipeline-model-parallel-size "$PP"); else mds_gpt+=(--no-pipeline-parallel); fi
