#!/bin/bash
# Megatron-DeepSpeed's unmodified pretrain_gpt.py with the Goldfish loss from its ds_config (000 §VIII-D;
# docs/plugins/goldfish.md): 4 CPU ranks, tensor-parallel 2 (ranks 0-1 and 2-3, each a GCD pair of the emulated
# topology), dense GPT, fp32, micro-batch 1, global batch 4, DeepSpeed ZeRO-1 with the client's Adam,
# gradient_clipping 1.0, --use-cpu-initialization (every run starts from the same weights). PP unset:
# --no-pipeline-parallel (GPTModel, TP 2 x DP 2, two micro-batches per iteration); PP=N: the client's default
# path, GPTModelPipe on DeepSpeed's PipelineEngine (PP=2: TP 2 x PP 2, four micro-batches per iteration).
#
# usage: examples/megatron_deepspeed_goldfish.sh MODE(goldfish|plain) [ARGS...]
# MODE goldfish: "ds_ext": {"goldfish": {"enabled": true, "k": K, "h": H}} (K, H from the environment, default
# 2 and 13) through python -m ds_ext.run; plain: the same run without ds_ext. ARGS are appended to
# pretrain_gpt.py's (later flags win, e.g. --train-iters 5). Sequence-sharded: PP=2 with --sequence-parallel
# --no-position-embedding (Megatron's, over the tensor group); the client's other sequence-sharded modes do not run
# (docs/plugins/goldfish.md, "Sequence-sharded inputs").
# needs MDS, DS0196, EXTRA, DATA: see examples/megatron_deepspeed_common.sh (examples/megatron_deepspeed_env.sh
# builds them and prints the exports).
# DUMP=DIR (tests/test_megatron_deepspeed_goldfish.py): through tests/megatron_goldfish_run.py, which writes
# each rank's parameters and the loss masks its loss multiplied; MODE hand (only there) is the plain run whose
# batch functions multiply loss_mask by the hand-written rule (tests/goldfish_reference.py).
set -euo pipefail
mode=$1; shift
source "$(dirname "$0")/megatron_deepspeed_common.sh"  # repo, mds_env, mds_gpt
k=${K:-2} h=${H:-13}
case $mode in
  goldfish) ds_ext=', "ds_ext": {"topology": {"preset": "frontier", "sizes": {"gpu": 1}, "emulate": true},
      "goldfish": {"enabled": true, "k": '$k', "h": '$h'}}'
    run=(-m ds_ext.run pretrain_gpt.py) ;;
  plain|hand) ds_ext='' run=("$repo/tests/megatron_deepspeed_reference.py" pretrain_gpt.py) ;;
  *) echo "MODE: goldfish | plain (got $mode)" >&2; exit 2 ;;
esac
if [ -n "${DUMP:-}" ]; then
  run=("$repo/tests/megatron_goldfish_run.py" "$DUMP" "$mode" "$k" "$h" pretrain_gpt.py)
elif [ "$mode" = hand ]; then
  echo "MODE hand needs DUMP=DIR (tests/megatron_goldfish_run.py)" >&2; exit 2
fi
cfg=$(mktemp --suffix=.json)
trap 'rm -f "$cfg"' EXIT
cat > "$cfg" <<JSON
{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
 "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": true, "gradient_clipping": 1.0$ds_ext}
JSON
cd "$MDS"
env "${mds_env[@]}" LOCAL_SIZE=4 torchrun --standalone --nproc_per_node 4 "${run[@]}" \
  --tensor-model-parallel-size 2 --use-cpu-initialization --global-batch-size 4 --deepspeed_config "$cfg" \
  "${mds_gpt[@]}" "$@"
