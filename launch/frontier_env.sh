# Environment of a ds_ext job on Frontier (OLCF), sourced by the batch scripts in launch/.
# Needs: DS_EXT_VENV (the Python environment with ds_ext) and DS_EXT_RCCL_PLUGIN_DIR (an
# aws-ofi-rccl build: lib/librccl-net.so). 004 found the AWS OFI RCCL plugin necessary for
# stable communication on Frontier: it runs RCCL over libfabric's CXI provider on Slingshot.
# NCCL_NET="AWS Libfabric" makes RCCL fail at start if the plugin does not load, instead of
# silently falling back to TCP sockets. Site modules default to what OLCF documents for
# PyTorch; override DS_EXT_MODULES for your installation.
die() { echo "ds_ext: $*" >&2; exit 2; }

: "${DS_EXT_VENV:?set DS_EXT_VENV to the Python environment that has ds_ext (its bin/activate is sourced)}"
: "${DS_EXT_RCCL_PLUGIN_DIR:?set DS_EXT_RCCL_PLUGIN_DIR to the aws-ofi-rccl installation (lib/librccl-net.so)}"
: "${SLURM_JOB_NODELIST:?run inside a Slurm allocation (sbatch / salloc)}"

DS_EXT_MODULES=${DS_EXT_MODULES-PrgEnv-gnu rocm craype-accel-amd-gfx90a}
if [[ -n "$DS_EXT_MODULES" ]]; then
    type module >/dev/null 2>&1 || die "the 'module' command is missing; load $DS_EXT_MODULES yourself and set DS_EXT_MODULES=''"
    # shellcheck disable=SC2086
    module load $DS_EXT_MODULES || die "module load $DS_EXT_MODULES failed"
fi
[[ -f "$DS_EXT_VENV/bin/activate" ]] || die "DS_EXT_VENV=$DS_EXT_VENV has no bin/activate"
# shellcheck disable=SC1091
source "$DS_EXT_VENV/bin/activate"

plugin_lib="$DS_EXT_RCCL_PLUGIN_DIR/lib"
[[ -f "$plugin_lib/librccl-net.so" ]] || die "no $plugin_lib/librccl-net.so: build aws-ofi-rccl (libfabric) first"
export LD_LIBRARY_PATH="$plugin_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NET="AWS Libfabric"        # the plugin or nothing: no silent TCP fallback
export NCCL_SOCKET_IFNAME=hsn0         # bootstrap on the Slingshot NICs
export NCCL_CROSS_NIC=1                # Slingshot is not rail-optimised
export NCCL_NET_GDR_LEVEL=PHB          # GPU-direct RDMA for a GCD and a NIC on one NUMA node (001 §6.1.1)
export FI_PROVIDER=cxi                 # libfabric's Slingshot provider
export FI_CXI_ATS=0                    # stability with RCCL (OLCF)
export FI_MR_CACHE_MONITOR=userfaultfd
export FI_CXI_DEFAULT_CQ_SIZE=131072   # large jobs overflow the default completion queue
# 001 §6.1.1 ("Communication Tuning"): no eager messaging in the CXI provider, which for the
# 16 MB - 1 GB messages of training's all-gathers and reduce-scatters speeds up collectives of
# both RCCL and Cray MPICH; and no SDMA engine, so transfers bypass the host.
export FI_CXI_RDZV_THRESHOLD=0
export FI_CXI_RDZV_GET_MIN=0
export FI_CXI_RDZV_EAGER_SIZE=0
export HSA_ENABLE_SDMA=0
# 001 §6.1.1 ("Process Placement"): each rank on the NIC of its NUMA domain, GCDs 2k and 2k+1
# on NIC k (Cray MPICH's collectives, for MPI beside RCCL; RCCL picks its NIC from the topology).
export MPICH_OFI_NIC_POLICY=USER
export MPICH_OFI_NIC_MAPPING="0:0-1;1:2-3;2:4-5;3:6-7"

# MIOpen's kernel database in node-local /tmp (the shared home file system serialises it);
# the directory is created on every node before training starts.
export MIOPEN_USER_DB_PATH="/tmp/miopen-${USER:-ds_ext}-${SLURM_JOB_ID:-0}"
export MIOPEN_CUSTOM_CACHE_DIR="$MIOPEN_USER_DB_PATH"

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk "NR == 1")  # reads all: no SIGPIPE under pipefail
export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-7}

# One task per GCD, 8 per node, node-major: with 7 cores per task bound in order, the
# closest GCD of local tasks 2k and 2k+1 are the two GCDs of one MI250X, the layout the
# "frontier" topology preset assumes (gcd level = ranks 2k, 2k+1).
DS_EXT_SRUN=(srun --ntasks-per-node=8 --gpus-per-task=1 --gpu-bind=closest --cpus-per-task=7 --cpu-bind=cores)
srun --ntasks-per-node=1 mkdir -p "$MIOPEN_USER_DB_PATH"
