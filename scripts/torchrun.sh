#!/usr/bin/env bash
# Launch `cohort` with torchrun on this node; run the same line on every node of a multi-node job.
#
#   NPROC_PER_NODE=8 scripts/torchrun.sh fit -c configs/trainer/ddp_gpu_bf16.yaml -c configs/gpt2/pretrain.yaml
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 scripts/torchrun.sh fit -c configs/trainer/multinode_gpu_bf16.yaml ...
#   DRY_RUN=1 NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 scripts/torchrun.sh fit ...   # print the command only
#
# NNODES           machines in the job (1)
# NODE_RANK        this machine's index, 0 .. NNODES-1 (0)
# NPROC_PER_NODE   processes on this machine, one per GPU ("gpu" = all visible GPUs, else 1 on a CPU machine)
# MASTER_ADDR      address of node 0, reachable from every node (127.0.0.1)
# MASTER_PORT      free TCP port on node 0 for the c10d rendezvous (29500)
# RUN_ID           rendezvous id shared by the nodes of one job ($SLURM_JOB_ID or "cohort")
# LOCAL_ADDR       this node's address as the other nodes reach it (default: what its hostname resolves to)
# MAX_RESTARTS     times torchrun restarts all ranks after one fails (3); a restarted run resumes from its newest
#                  checkpoint by itself, losing at most the steps since it. 0 makes a failure end the job.
# The trainer config must agree: trainer.num_nodes = NNODES and trainer.devices = NPROC_PER_NODE.
#
# Fault-tolerant replica groups (configs/trainer/fault_tolerant_*.yaml) on several machines: one machine per group,
# each its own torchrun job (NNODES=1, NPROC_PER_NODE processes), all sharing one lighthouse, one job store and one
# RUN_ID:
#   START_LIGHTHOUSE=1 REPLICA_GROUP=0 LIGHTHOUSE=http://node0:29510 RUN_ID=job7 scripts/torchrun.sh fit ...  # node0
#   REPLICA_GROUP=1 LIGHTHOUSE=http://node0:29510 RUN_ID=job7 scripts/torchrun.sh fit ...                     # node1
#   START_LIGHTHOUSE=1 LIGHTHOUSE=http://node0:29510 scripts/torchrun.sh  # or: the lighthouse and store alone
# REPLICA_GROUP    this machine's replica group, 0 .. replica_groups-1
# LIGHTHOUSE       http://host:port of the job's torchft lighthouse, reachable from every group
# JOB_STORE        host:port of the job's store (torch's TCPStore), where the groups wait for each other at the start
#                  and mark the job finished, so that a group restarted after that ends (exit 0) instead of training
#                  alone (default: LIGHTHOUSE's host, its port + 1)
# START_LIGHTHOUSE 1: start the lighthouse, with MIN_REPLICAS (1) groups per step, and the job store here first, on
#                  LIGHTHOUSE's and JOB_STORE's ports (on one machine only). With REPLICA_GROUP they stop when this
#                  machine's torchrun ends; a group restarted after that finds neither and fails. Without
#                  REPLICA_GROUP and arguments they serve until stopped (SIGTERM, Ctrl-C): one job each, as
#                  scripts/slurm/fault_tolerant.sbatch runs them, outliving any group.
# Each group writes into lightning_logs/version_$RUN_ID/replica_group_G. The groups wait for each other at the start
# (for the config's replica_groups, within its timeout); a group restarted later takes a live group's state.
# On clusters whose hostname resolves to 127.0.0.1, set LOCAL_ADDR, and NCCL_SOCKET_IFNAME (GPUs) or
# GLOO_SOCKET_IFNAME (CPUs) to the interface that carries it, or other nodes are told to connect to loopback.
set -euo pipefail

nnodes=${NNODES:-1}
node_rank=${NODE_RANK:-0}
master_addr=${MASTER_ADDR:-127.0.0.1}
master_port=${MASTER_PORT:-29500}
run_id=${RUN_ID:-${SLURM_JOB_ID:-cohort}}
max_restarts=${MAX_RESTARTS:-3}  # enough for rare faults (a lost rank, a flaky link); a bug that fails every time
                                 # costs 4 attempts, then the job ends with torchrun's report
if [[ -n "${NPROC_PER_NODE:-}" ]]; then
  nproc=$NPROC_PER_NODE
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  nproc=gpu
else
  nproc=1
fi

# Node 0 hosts the rendezvous store. Said outright, because torchrun's guess (does MASTER_ADDR name this machine?)
# fails where the hostname resolves to 127.0.0.1.
is_host=$([[ "$node_rank" == 0 ]] && echo 1 || echo 0)

# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a fresh store for the ranks of every attempt. torchrun's agent otherwise
# lends its own rendezvous store to all attempts, and a restarted rank reads the dead ranks' addresses from it and
# fails or hangs (pytorch/pytorch#135712).
# TORCH_NCCL_ASYNC_ERROR_HANDLING=3: a timed-out NCCL collective ends the process (after the flight recorder's dump)
# without aborting the communicator, which can hang; torchrun would pass 1 to the ranks.
command=(env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}"
  python -m torch.distributed.run
  --nnodes="$nnodes" --node_rank="$node_rank" --nproc_per_node="$nproc" --max-restarts="$max_restarts"
  --rdzv_backend=c10d --rdzv_endpoint="$master_addr:$master_port" --rdzv_id="$run_id" --rdzv_conf=is_host="$is_host"
  ${LOCAL_ADDR:+--local_addr="$LOCAL_ADDR"} -m app "$@")

if [[ -n "${REPLICA_GROUP:-}${START_LIGHTHOUSE:-}" ]]; then
  : "${LIGHTHOUSE:?REPLICA_GROUP and START_LIGHTHOUSE need LIGHTHOUSE=http://host:port of the torchft lighthouse}"
  lighthouse_address=${LIGHTHOUSE#*://}  # host:port
  job_store=${JOB_STORE:-${lighthouse_address%:*}:$(( ${lighthouse_address##*:} + 1 ))}
  export RUST_LOG=${RUST_LOG:-warn}  # torchft's own log (lighthouse, groups): a few lines per step otherwise
fi
if [[ -n "${REPLICA_GROUP:-}" ]]; then
  command=(env COHORT_REPLICA_GROUP="$REPLICA_GROUP" TORCHFT_LIGHTHOUSE="$LIGHTHOUSE" COHORT_JOB_STORE="$job_store"
    COHORT_RUN_VERSION="version_$run_id" "${command[@]}")
elif [[ -n "${START_LIGHTHOUSE:-}" && $# -eq 0 ]]; then
  command=()  # the lighthouse and the job store alone
fi
lighthouse=()
store=()
if [[ -n "${START_LIGHTHOUSE:-}" ]]; then
  lighthouse=(torchft_lighthouse --min_replicas "${MIN_REPLICAS:-1}" --bind "[::]:${lighthouse_address##*:}")
  # the job store: torch's own TCPStore server, open until stopped
  store=(python -c 'import signal, sys, torch.distributed as dist
store = dist.TCPStore("0.0.0.0", int(sys.argv[1]), is_master=True, wait_for_workers=False)
signal.pause()' "${job_store##*:}")
fi

if [[ -n "${DRY_RUN:-}" ]]; then
  if [[ ${#lighthouse[@]} -gt 0 ]]; then
    printf '%q ' "${lighthouse[@]}"; echo "&"
    printf '%q ' "${store[@]}"; echo "&"
  fi
  if [[ ${#command[@]} -gt 0 ]]; then printf '%q ' "${command[@]}"; echo; fi
elif [[ ${#lighthouse[@]} -gt 0 ]]; then
  "${lighthouse[@]}" &
  lighthouse_pid=$!
  "${store[@]}" &
  store_pid=$!
  trap 'kill "$lighthouse_pid" "$store_pid" 2>/dev/null' EXIT
  trap 'exit 143' TERM  # stopped: the EXIT trap stops the lighthouse and the store
  if [[ ${#command[@]} -gt 0 ]]; then "${command[@]}"; else wait; fi
else
  exec "${command[@]}"
fi
