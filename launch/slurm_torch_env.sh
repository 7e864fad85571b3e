# torch.distributed's variables for one srun task (sourced inside the task): what the
# deepspeed / torchrun launchers would set. For scripts that start torch.distributed
# themselves (Megatron-DeepSpeed's pretrain_gpt.py reads RANK / WORLD_SIZE / LOCAL_RANK).
export RANK=$SLURM_PROCID
export WORLD_SIZE=$SLURM_NTASKS
export LOCAL_RANK=$SLURM_LOCALID
export LOCAL_SIZE=${SLURM_NTASKS_PER_NODE%%(*}
export LOCAL_SIZE=${LOCAL_SIZE%%,*}
export LOCAL_WORLD_SIZE=$LOCAL_SIZE
