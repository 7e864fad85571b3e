#!/bin/bash
# Megatron-DeepSpeed's unmodified pretrain_gpt.py with TED on 4 CPU ranks (TP 2, EP 2, 2 experts,
# ZeRO stage 0 + gradient_clipping 1.0 as its examples_deepspeed/MoE config), 10 iterations.
#
# usage: [PP=N] [TP=T] examples/megatron_deepspeed_ted.sh ETP(0|1) RECOMPUTE(0|1) MODE(on|off|cac-off|deepspeed|zero1|zero1-deepspeed|zero-topo) [ARGS...]
# MODE: ds_ext TED with DTD + CAC on, both off, CAC off; or deepspeed: plain DeepSpeed MoE, no ds_ext
# (the reference of whole experts). zero1 / zero-topo: 8 ranks (global batch 4), TED with
# DeepSpeed ZeRO-1 (--create-moe-param-group) / with ZeRO-topo unquantized (dense part over the data
# group, experts over their expert-data group; whole experts over tensor x expert-data); zero1-deepspeed:
# zero1's run under plain DeepSpeed MoE, no ds_ext (its reference). ARGS are appended to pretrain_gpt.py's
# (later flags win). TP (default 2): the tensor-parallel degree; PP=N (examples/megatron_deepspeed_common.sh):
# GPTModelPipe on DeepSpeed's PipelineEngine, N stages; at TP > 1 with PP > 1 the config turns DeepSpeed's
# pipe / grad partitioning off, which the client requires for MoE there. CLIP (default 1.0): gradient_clipping.
# STAGE (zero1 / zero1-deepspeed, default 1): their ZeRO stage (0: the same 8 ranks without ZeRO).
# needs MDS, DS0196, EXTRA, DATA: see examples/megatron_deepspeed_common.sh (examples/megatron_deepspeed_env.sh
# builds them and prints the exports).
# --use-cpu-initialization with split experts: Megatron initializes every weight whole and slices it, so
# each tensor-parallel degree starts from the serial model's weights (tests/test_megatron_deepspeed_ted.py
# compares with it). Not with whole experts: there the client slices a whole expert by the tensor rank
# (core/tensor_parallel/layers.py, _initialize_affine_weight_cpu: weight_list[rank::world_size] of a
# one-element list) and tensor rank 1 fails with "torch.cat(): expected a non-empty list of Tensors".
set -euo pipefail
etp=$1; rec=$2; mode=$3; shift 3
source "$(dirname "$0")/megatron_deepspeed_common.sh"  # repo, mds_env, mds_gpt
dtd=true; cac=true
[ "$mode" = off ] && dtd=false && cac=false
[ "$mode" = cac-off ] && cac=false
ranks=4 batch=2 stage=0 more='' extra=() tp=${TP:-2} pipeline=''
[ "${PP:-1}" -gt 1 ] && [ "$tp" -gt 1 ] && pipeline=', "pipeline": {"pipe_partitioned": false, "grad_partitioned": false}'
frontier='"topology": {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": true}, '
case $mode in
  zero1|zero1-deepspeed) ranks=8 batch=4 stage=${STAGE:-1} more=$frontier extra+=(--create-moe-param-group) ;;
  zero-topo) ranks=8 batch=4 more=$frontier zero_topo=', "zero_topo": {"enabled": true, "preset": "zero_topo",
      "weights": {"gather_bits": 16}, "gradients": {"bits": 16, "hops": 1}, "secondary": {"bits": 16}}' ;;
esac
ds_ext=', "ds_ext": {'$more'"ted": {"enabled": true, "tensor_parallel": '$tp', "expert_parallel": 2,
                    "duplicate_token_dropping": '$dtd', "comm_aware_checkpointing": '$cac'}'${zero_topo:-}'}'
run=(-m ds_ext.run pretrain_gpt.py)
case $mode in deepspeed|zero1-deepspeed) ds_ext='' run=("$repo/tests/megatron_deepspeed_reference.py" pretrain_gpt.py) ;; esac
# TED_INIT_DUMP=DIR: also write each rank's initial weights (tests/megatron_dump_init.py)
[ -n "${TED_INIT_DUMP:-}" ] && run=("$repo/tests/megatron_dump_init.py" "$TED_INIT_DUMP" pretrain_gpt.py)
# TED_GRAD_DUMP=DIR: also write each rank's gradients of the first step and the norm (tests/megatron_dump_grads.py)
[ -n "${TED_GRAD_DUMP:-}" ] && run=("$repo/tests/megatron_dump_grads.py" "$TED_GRAD_DUMP" "${run[@]}")
cfg=$(mktemp --suffix=.json)
cat > "$cfg" <<JSON
{"train_batch_size": $batch, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
 "zero_optimization": {"stage": $stage}, "zero_allow_untested_optimizer": true, "gradient_clipping": ${CLIP:-1.0}$pipeline$ds_ext}
JSON
[ "$etp" = 1 ] && extra+=(--enable-expert-tensor-parallelism --use-cpu-initialization)
[ "$rec" = 1 ] && extra+=(--checkpoint-activations --recompute-granularity full --recompute-method uniform)
cd "$MDS"
env "${mds_env[@]}" LOCAL_SIZE=$ranks torchrun --standalone --nproc_per_node $ranks "${run[@]}" \
  --tensor-model-parallel-size "$tp" --moe-expert-parallel-size 2 --num-experts 2 --topk 1 \
  --moe-train-capacity-factor 1.0 --moe-min-capacity 0 --global-batch-size $batch --deepspeed_config "$cfg" \
  "${mds_gpt[@]}" "${extra[@]}" "$@"
