#!/usr/bin/env bash
# Run a ds_ext training script on CPU ranks of this host with the real DeepSpeed launcher.
# The "ds_ext.topology" block of the config imposes the emulated hierarchy by rank order
# (configs/demo.json: 2 nodes x 2 GPUs x 2 GCDs over 8 ranks).
#   usage: launch/local_cpu.sh [NUM_RANKS] [CONFIG] [extra args for the script...]
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=${1:-8}
config=${2:-configs/demo.json}
shift $(( $# > 2 ? 2 : $# ))
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore::FutureWarning
port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
exec deepspeed --num_gpus "$ranks" --master_port "$port" examples/train.py --deepspeed_config "$config" "$@"
