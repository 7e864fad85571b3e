#!/bin/bash
# One of 004's Frontier recipes (configs/frontier/*.recipe, as launch/frontier_megatron.sbatch runs it)
# shrunk to 8 CPU ranks and run on Megatron-DeepSpeed's unmodified pretrain_gpt.py (its default path,
# GPTModelPipe on DeepSpeed's PipelineEngine). 8 ranks emulate Frontier in miniature
# (2 nodes x 2 MI250X x 2 GCDs).
#
# usage: examples/frontier_recipe_cpu.sh RECIPE MODE [ARGS...]
# MODE: ds_ext = the recipe's ds_config (RECIPE_CONFIG: ZeRO-topo's pipeline form, its default quantized
# preset) in the recipe's dtype (fp16); plain = the recipe's published DeepSpeed ZeRO-1 (RECIPE_PLAIN_CONFIG,
# ds_ext's block removed: no ds_ext at all); unquantized-fp32 / plain-fp32 = the same two in fp32 (no --fp16,
# no fp16 section), ZeRO-topo with 16-bit gradient wires in one hop (equal to ZeRO-1 to fp32 rounding).
# ARGS are appended to pretrain_gpt.py's (later flags win, e.g. --seed 1235).
#
# The shrink: what the recipe fixes stays (micro-batch size, --fp16, --checkpoint-activations,
# --deepspeed-activation-checkpointing, the ds_config's loss scaler, clipping and activation checkpointing
# sections); tensor and pipeline parallel become min(TP, 2) and min(PP, 2), the data-parallel degree
# the rest of the 8 ranks (TP 2 x PP 2 x DP 2 for all three recipes: the only shape with every axis >= 2);
# 2 layers per stage, hidden 64, 4 heads, sequence 64 (the tiny GPT of megatron_deepspeed_common.sh);
# 2 x PP micro-batches per step (004's m >= p); --use-flash-attn-v2 is dropped (flash-attn's GPU kernels;
# the client's own attention runs instead). Any other recipe argument is refused. SHRINK_ONLY=1 prints the
# ds_config the mode takes and the shrunk arguments, and runs nothing.
# needs MDS, DS0196, EXTRA, DATA (examples/megatron_deepspeed_env.sh prints them). Runs through
# tests/megatron_dump_final.py (as python -m ds_ext.run for ds_ext, plain DeepSpeed otherwise; it also lets
# DeepSpeed's CPU accelerator take fp16): FINAL_DUMP=DIR keeps its per-rank dumps.
set -euo pipefail
recipe=$1 mode=$2; shift 2
case $mode in ds_ext | plain | unquantized-fp32 | plain-fp32) ;;
  *) echo "MODE: ds_ext | plain | unquantized-fp32 | plain-fp32 (got $mode)" >&2; exit 2 ;;
esac
[ -f "$recipe" ] || { echo "no recipe $recipe" >&2; exit 2; }
recipe=$(cd "$(dirname "$recipe")" && pwd)/$(basename "$recipe")
# shellcheck disable=SC1090
source "$recipe"
ranks=8 tp='' pp='' mbs='' kept=()
set -- "${RECIPE_ARGS[@]}" -- "$@"
while [ "$1" != -- ]; do
  case $1 in
    --tensor-model-parallel-size) tp=$(($2 < 2 ? $2 : 2)); shift 2 ;;
    --pipeline-model-parallel-size) pp=$(($2 < 2 ? $2 : 2)); shift 2 ;;
    --micro-batch-size) mbs=$2; shift 2 ;;
    --num-layers | --hidden-size | --num-attention-heads | --seq-length | --max-position-embeddings | --global-batch-size)
      shift 2 ;;
    --use-flash-attn-v2) shift ;;
    --fp16) [[ $mode == *-fp32 ]] || kept+=(--fp16); shift ;;
    --checkpoint-activations | --deepspeed-activation-checkpointing) kept+=("$1"); shift ;;
    *) echo "frontier_recipe_cpu.sh: recipe argument $1 has no CPU shrink" >&2; exit 2 ;;
  esac
done
shift
: "${tp:?recipe without --tensor-model-parallel-size}" "${pp:?recipe without --pipeline-model-parallel-size}"
: "${mbs:?recipe without --micro-batch-size}"
dp=$((ranks / (tp * pp)))
gbs=$((mbs * dp * 2 * pp))
config=$RECIPE_CONFIG how=ds_ext
case $mode in plain | plain-fp32) config=$RECIPE_PLAIN_CONFIG how=plain ;; esac
shrunk=(--tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp" --num-layers $((2 * pp))
  --micro-batch-size "$mbs" --global-batch-size "$gbs" "${kept[@]}")
if [ -n "${SHRINK_ONLY:-}" ]; then  # what this recipe becomes on 8 CPU ranks, nothing run
  echo "$config ${shrunk[*]}"
  exit 0
fi
PP=$pp
source "$(dirname "$0")/megatron_deepspeed_common.sh"  # repo, mds_env, mds_gpt (PP set: the PipelineEngine path)
cfg=$(mktemp --suffix=.json)
trap 'rm -f "$cfg"' EXIT
python - "$repo/$config" "$cfg" "$mode" "$gbs" <<'PY'
import json, sys

src, dst, mode, gbs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cfg = json.load(open(src))
cfg.pop("_comment", None)
cfg |= {"train_batch_size": gbs, "steps_per_print": 1, "zero_allow_untested_optimizer": True}  # the client's torch Adam
if mode.endswith("-fp32"):
    cfg.pop("fp16")
if mode.startswith("plain"):
    cfg.pop("ds_ext")  # the published ZeRO-1 alone
else:
    cfg["ds_ext"]["topology"] = {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}
    if mode == "unquantized-fp32":
        cfg["ds_ext"]["zero_topo"]["gradients"] = {"bits": 16, "hops": 1}
json.dump(cfg, open(dst, "w"))
PY
dump=${FINAL_DUMP:-$(mktemp -d)}
[ -n "${FINAL_DUMP:-}" ] || trap 'rm -rf "$cfg" "$dump"' EXIT
cd "$MDS"
env "${mds_env[@]}" LOCAL_SIZE=$ranks torchrun --standalone --nproc_per_node $ranks \
  "$repo/tests/megatron_dump_final.py" "$dump" "$how" pretrain_gpt.py \
  "${mds_gpt[@]}" --use-cpu-initialization --deepspeed_config "$cfg" "${shrunk[@]}" "$@"
