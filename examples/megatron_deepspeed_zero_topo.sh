#!/bin/bash
# Megatron-DeepSpeed's unmodified pretrain_gpt.py, dense GPT, with ZeRO-topo under Megatron tensor
# parallelism: 8 CPU ranks emulating Frontier in miniature (2 nodes x 2 MI250X x 2 GCDs), tensor-parallel
# 2 (the GCD pair of an MI250X), so data-parallel 4 (one GCD per MI250X, crossing the node), fp32,
# micro-batch 1, global batch 4, 10 iterations, gradient_clipping 1.0, --no-pipeline-parallel; with PP=N the
# client's default path instead (GPTModelPipe on DeepSpeed's PipelineEngine, N stages: ZeRO-topo's pipeline
# form), e.g. PP=2: TP 2 x PP 2 x DP 2, two micro-batches per iteration (004's TP x PP x ZeRO-1 recipe shape).
#
# usage: examples/megatron_deepspeed_zero_topo.sh MODE(zero1|unquantized|quantized) [ARGS...]
# MODE: zero1 = plain DeepSpeed ZeRO stage 1, no ds_ext (the reference); unquantized = ZeRO-topo with
# 16-bit wires everywhere (equals ZeRO-1 to fp32 rounding); quantized = ZeRO-topo's default preset.
# ARGS are appended to pretrain_gpt.py's (later flags win, e.g. --seed 1235).
# needs MDS, DS0196, EXTRA, DATA: see examples/megatron_deepspeed_common.sh (examples/megatron_deepspeed_env.sh
# builds them and prints the exports).
# --use-cpu-initialization: Megatron draws every weight whole from the seed and slices it, so both
# sides start from the same weights. The client's Adam (torch.optim.Adam: no apex here) is passed to
# DeepSpeed, hence zero_allow_untested_optimizer for ZeRO-1; ZeRO-topo replaces DeepSpeed's ZeRO
# (stage 0 in its config).
# FINAL_DUMP=DIR: also write each rank's initial and final parameters and, under ZeRO-topo, the last
# step's ledger (tests/megatron_dump_final.py).
# PLUGINS='"tiled_optimizer": {...}' (or "pccl"): more ds_ext sections, beside ZeRO-topo or, with zero1,
# beside DeepSpeed's ZeRO-1 (then through ds_ext's launcher too).
# FP16 (set, possibly empty): train in fp16, --fp16 and the ds_config's "fp16" section (DeepSpeed's dynamic
# loss scaler) with FP16's keys added, e.g. FP16='"initial_scale_power": 24, "loss_scale_window": 2'.
set -euo pipefail
mode=$1; shift
source "$(dirname "$0")/megatron_deepspeed_common.sh"  # repo, mds_env, mds_gpt
topology='"topology": {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": true}'
plugins=${PLUGINS:+, $PLUGINS}
fp16=''
[ -n "${FP16+set}" ] && fp16=', "fp16": {"enabled": true'${FP16:+, $FP16}'}'
case $mode in
  zero1) stage=1 ds_ext=''
    [ -n "${PLUGINS:-}" ] && ds_ext=', "ds_ext": {'$topology$plugins'}' ;;
  unquantized) stage=0 wire='"weights": {"gather_bits": 16}, "secondary": {"bits": 16}, '
    [ -n "${PP:-}" ] && wire=''  # the pipeline form keeps weights whole: no weight wire to set
    ds_ext=', "ds_ext": {'$topology', "zero_topo": {"enabled": true, "preset": "zero_topo",
      '$wire'"gradients": {"bits": 16, "hops": 1}}'$plugins'}' ;;
  quantized) stage=0 ds_ext=', "ds_ext": {'$topology', "zero_topo": {"enabled": true, "preset": "zero_topo"}'$plugins'}' ;;
  *) echo "MODE: zero1 | unquantized | quantized (got $mode)" >&2; exit 2 ;;
esac
run=(-m ds_ext.run pretrain_gpt.py)
[ -z "$ds_ext" ] && run=("$repo/tests/megatron_deepspeed_reference.py" pretrain_gpt.py)
if [ -n "${FINAL_DUMP:-}" ]; then
  how=ds_ext; [ -z "$ds_ext" ] && how=plain
  run=("$repo/tests/megatron_dump_final.py" "$FINAL_DUMP" "$how" pretrain_gpt.py)
fi
cfg=$(mktemp --suffix=.json)
trap 'rm -f "$cfg"' EXIT
cat > "$cfg" <<JSON
{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
 "zero_optimization": {"stage": $stage}, "zero_allow_untested_optimizer": true, "gradient_clipping": 1.0$fp16$ds_ext}
JSON
cd "$MDS"
env "${mds_env[@]}" LOCAL_SIZE=8 torchrun --standalone --nproc_per_node 8 "${run[@]}" \
  --tensor-model-parallel-size 2 --use-cpu-initialization --global-batch-size 4 --deepspeed_config "$cfg" \
  "${mds_gpt[@]}" ${fp16:+--fp16} "$@"
