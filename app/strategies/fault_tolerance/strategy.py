"""Fault-tolerant data parallelism with torchft: replica groups that train on without a member that died, and take it
back, with a live peer's weights, once it restarts (configs/trainer/fault_tolerant_cpu.yaml,
fault_tolerant_gpu_bf16.yaml; groups of several processes: fault_tolerant_groups_cpu.yaml).

    cohort fit -c configs/quickstart.yaml -c configs/trainer/fault_tolerant_cpu.yaml

The job. ``cohort fit`` starts torchft's lighthouse (unless ``lighthouse`` names a running one) and one torchrun per
replica group (``python -m torch.distributed.run --standalone --nproc-per-node D --max-restarts N -m app fit ...``),
each with ``trainer.devices`` processes, and waits for them. A replica group is a whole copy of the model, sharded
over its processes (FSDP2, as under ModelParallelStrategy; one process holds it whole); the groups meet at each
optimizer step, rank r of a group with rank r of the others, each rank running torchft's Manager (group_rank r):

    quorum     before a step reads its data, each group asks the lighthouse which groups take part in the step;
               a group that missed earlier steps (restarted) first receives the weights, optimizer state, schedule
               and step count of a live peer over HTTP, rank r from the peer's rank r (its shards), read as data
               (never unpickled code), never from disk
    average    after the step's backward (and FSDP2's reduce-scatter within the group), one all-reduce of each
               rank's gradient shards with the same rank of the quorum's other groups averages the gradient
    commit     the groups agree that the all-reduce succeeded; only then is the optimizer step taken. A step whose
               all-reduce failed (a group died in it) is taken by none and done again, on the same samples

A group with a process that dies (torchrun stops its other processes) is dropped from the next quorum (after the
lighthouse's heartbeat timeout) and torchrun restarts it; the others go on without waiting for it. The job stops only
if fewer than ``min_replicas`` groups are alive.

Batch and learning rate. The global batch stays ``data.global_batch_size`` whatever the quorum: of n groups, each
reads G / n samples of the committed step's global batch, an equal part on each of its processes, in the run's
number of micro-batches (so a group's micro-batches grow while the quorum is smaller: memory to keep in reserve),
and the gradient is their mean. So every step reads what one process would have read and takes the same update, up
to the order of sums; the learning rate and its schedule follow the committed steps. A step that did not commit is
done again on the same samples. Each group logs the quorum size, the samples it read, its failed commits, recoveries
and time in quorums (``fault_tolerance/*`` in TensorBoard).

Per group. Each group writes TensorBoard and checkpoints to ``lightning_logs/version_N/replica_group_G/`` (all
groups hold the same weights; any one's checkpoint resumes the job). Preemption (SIGTERM, SIGUSR1 to ``cohort``) stops
every group after a checkpoint; the bad-step guard and the monitor work per group, on the averaged gradient.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import urllib.request
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed import TCPStore
from torch.distributed._serialization import _streaming_load

from app.safety.launch_environment import replica_group, torchrun_restart
from app.strategies.fault_tolerance.job import (
    JOB_FINISHED,
    ReplicaGroupsLauncher,
    check_lighthouse_answers,
    job_store,
    wait_for_every_group,
)
from app.strategies.fault_tolerance.settings import FaultToleranceSettings
from app.strategies.fault_tolerance.shards import (
    average_local_gradients,
    load_local_shards,
    local_shards,
    optimizer_state_on_mesh,
)
from core.errors import UserError
from datamodules.base import ResumableDataLoader
from datamodules.samplers import GlobalBatchSampler, StepMicroBatches


class FaultTolerantStrategy(ModelParallelStrategy):
    """A replica group of trainer.devices x num_nodes processes, the network sharded over them (FSDP2, as
    ModelParallelStrategy shards it over its data-parallel ranks); on each rank, torchft's Manager joins the groups'
    quorum, averages the rank's gradient shards with the same rank of the other groups and decides whether each step
    commits. In the process that starts the job, the launcher starts the groups."""

    def __init__(self, replica_groups: int = 3, min_replicas: int = 1, lighthouse: str | None = None,
                 max_restarts: int = 10, timeout: timedelta = timedelta(seconds=30),
                 heartbeat_timeout: timedelta = timedelta(seconds=3),
                 start_timeout: timedelta = timedelta(minutes=5)) -> None:
        """
        Args:
            replica_groups: copies of the model, each trainer.devices x num_nodes processes (the model sharded over
                them); each group reads global_batch_size / replica_groups samples per step.
            min_replicas: groups a step needs to commit; with fewer alive the others wait for them.
            lighthouse: http://host:port of a running torchft lighthouse (one per job, e.g. started by the launch
                script); null: ``cohort fit`` starts one on this machine.
            max_restarts: times torchrun restarts a group whose process died, before the job goes on without it.
            timeout: the longest a quorum, the gradient all-reduce across the groups or a recovery may take; a group
                that does not answer within it is left out. The collectives within a group (FSDP2's, a checkpoint's
                barriers) keep torch's default timeout, so a slow checkpoint write does not end the group.
            heartbeat_timeout: a group silent this long is dead to the lighthouse (the lighthouse this job starts).
            start_timeout: at the job's start, how long the groups that are up wait for the others (started by
                their own torchrun or srun, on other machines, at other times) before they train without them; a
                late group joins at a later step.
        """
        # the pre-flight checks have checked the values (app/cli/preflight.py); one file per group's checkpoint, as a
        # single process writes it. The group's sizes are known once Lightning has counted its processes. The
        # group's own process group keeps torch's default timeout: ``timeout`` bounds what crosses the groups
        super().__init__(save_distributed_checkpoint=False)
        self.settings = FaultToleranceSettings(replica_groups, min_replicas, lighthouse, max_restarts, timeout,
                                               heartbeat_timeout, start_timeout)
        self.manager: Any = None  # torchft's Manager, in a group's process from setup on
        self.committed_steps: CommittedSteps | None = None  # in a group's process, from setup_environment on
        self.recoveries = 0  # peer states this group has loaded
        self.quorum_seconds = 0.0  # spent waiting for quorums (and recoveries) since the start
        self._training_loader = ResumableDataLoader([])  # the training stream, from process_dataloader on
        self.job_store: TCPStore | None = None  # the job's, where groups count in at the start and the end
        self._rejoined = not torchrun_restart()  # a restarted group has rejoined once it has a live group's state
        self._store: TCPStore | None = None

    def _configure_launcher(self) -> None:
        self._launcher = None if replica_group() is not None else ReplicaGroupsLauncher(self.settings)

    # ----- in a group's process -----
    def setup_environment(self) -> None:
        # every process of the group is one data-parallel rank: the network sharded over all of them
        self._data_parallel_size, self._tensor_parallel_size = self.num_nodes * self.num_processes, 1
        super().setup_environment()
        trainer = self.lightning_module.trainer
        if replica_group() is not None and trainer.state.fn == TrainerFn.FITTING:
            # a callback from here on, so that a resumed job restores the committed steps into it
            self.committed_steps = CommittedSteps(self)
            trainer.callbacks.insert(0, self.committed_steps)

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        if self.committed_steps is None:
            return
        settings, timeout = self.settings, self.settings.timeout
        lighthouse = os.environ.get("TORCHFT_LIGHTHOUSE", settings.lighthouse)
        if lighthouse is None:
            raise UserError(f"replica group {replica_group()} has no lighthouse: set TORCHFT_LIGHTHOUSE (LIGHTHOUSE for "
                            "scripts/torchrun.sh) or trainer.strategy.init_args.lighthouse to its http://host:port")
        check_lighthouse_answers(lighthouse, wait=timeout)
        os.environ["TORCHFT_LIGHTHOUSE"] = lighthouse  # where torchft's manager reads it
        # torchft says at every new quorum that it cannot reset NCCL's flight recorder, also where there is no NCCL
        logging.getLogger("torchft.manager").addFilter(lambda record: "flight recorder" not in record.getMessage())
        # the fault-tolerance extra (pyproject.toml): imported where it is used
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        # the store through which the quorum's groups find each other's gloo addresses and the group's ranks their
        # manager (the group's own, on its rank 0)
        if self.global_rank == 0:
            self._store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        store_host, store_port = self.broadcast((socket.gethostname(), self._store.port if self._store else 0))
        # the groups' gradient all-reduce: NCCL between GPUs (its timeout also bounds its non-blocking waits), gloo
        # between CPUs
        if self.root_device.type == "cuda":
            os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(timeout.total_seconds()))
            groups: Any = ProcessGroupNCCL(timeout=timeout)
        else:
            groups = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=groups, load_state_dict=self._load_peer_state,
            state_dict=self._peer_state, min_replica_size=settings.min_replicas, use_async_quorum=False,
            rank=self.global_rank, world_size=self.world_size, store_addr=store_host, store_port=store_port,
            replica_id=f"replica_group_{replica_group()}", timeout=timeout, quorum_timeout=timeout,
            checkpoint_transport=weights_only_http_transport(timeout),
            init_sync=False,  # every group builds the same initial weights from the seed: nothing to send at step 0
        )
        self.manager.load_state_dict(self.committed_steps.restored)
        self.job_store = job_store(timeout)
        if self.job_store is not None and not torchrun_restart():
            if self.global_rank == 0:  # the group counts in once
                wait_for_every_group(self.job_store, settings.replica_groups, settings.start_timeout)
            self.barrier()

    def process_dataloader(self, dataloader: object) -> object:
        """The training stream: at each step's start, the places of the global batch the step's quorum gives this
        group, cut into the run's number of micro-batches (larger ones while the quorum is smaller)."""
        sampler = getattr(dataloader, "sampler", None)
        if self.manager is None or not isinstance(sampler, GlobalBatchSampler):
            return dataloader
        assert isinstance(dataloader, ResumableDataLoader)
        sampler.next_step = self.start_step
        self._training_loader = ResumableDataLoader(
            dataloader.dataset, batch_sampler=StepMicroBatches(sampler, self.lightning_module.run_plan.accumulation),
            collate_fn=dataloader.collate_fn, pin_memory=dataloader.pin_memory)
        return self._training_loader

    def start_step(self) -> tuple[int, range]:
        """Join the next step's quorum (after a restart, first load a live peer's state) and return the committed
        step and this rank's places in its global batch: of the p-th of q equal shares (place p in a quorum of q),
        the r-th of n equal parts (rank r of the group's n)."""
        start = time.perf_counter()
        self.manager.start_quorum()
        place, quorum = self.manager.participating_rank(), self.manager.num_participants()
        seconds = time.perf_counter() - start
        self.quorum_seconds += seconds
        # asked for while the loader fetches: not time spent reading data, which the monitor reports as a stall
        self._training_loader.wait_seconds -= seconds
        if not self._rejoined:
            self._check_rejoined()
        # TensorBoard's step for what this step logs; Lightning advanced it also after a step that did not commit
        self.lightning_module.trainer.fit_loop.epoch_loop._batches_that_stepped = self.manager.current_step()
        share = self.lightning_module.run_plan.global_batch_size // max(quorum, 1)
        part = share // self.world_size
        # place None: not in the quorum, a step that cannot commit (fewer than min_replicas): any share will do
        start = (place or 0) * share + self.global_rank * part
        return self.manager.current_step(), range(start, start + part)

    def _check_rejoined(self) -> None:
        """After a restart, the first quorum must hold a live group to take the run's state from: alone, this
        group would train from its initial weights. Alone because the others have finished, it ends too."""
        alone = self.manager.num_participants() == 1 and self.settings.replica_groups > 1 and self.recoveries == 0
        if not alone:
            self._rejoined = True
            return
        if self.job_store is not None and self.job_store.check([JOB_FINISHED]):
            rank_zero_info(f"replica group {replica_group()} restarted after the job had finished: nothing to train")
            raise SystemExit(0)
        raise UserError(f"replica group {replica_group()} restarted, but no other group is alive to give it the "
                        "run's state: resume the job from its newest checkpoint with the same command and "
                        "--ckpt_path last")

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """After the step's last backward, the gradient averaged over the quorum, then the commit decision; a step
        that does not commit leaves no gradient, so the optimizer changes nothing (weights, moments, step count)."""
        if self.manager is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_average() -> Any:
            result = closure()
            self.average_gradients(optimizer)
            if not self.manager.should_commit():
                optimizer.zero_grad(set_to_none=True)
            return result

        return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    def average_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """One all-reduce of this rank's gradient shards, flattened, with the same rank of the quorum's other groups:
        the mean over the groups (FSDP2's reduce-scatter has averaged them over the group's ranks)."""
        params = [param for group in optimizer.param_groups for param in group["params"] if param.requires_grad]
        average_local_gradients(params, self.manager.allreduce)

    def _peer_state(self) -> dict[str, Any]:
        """What a restarted group needs to train on as this one: read between steps, while this group waits in the
        quorum."""
        trainer = self.lightning_module.trainer  # this rank's shards: the same rank of the other group takes them
        return {"model": local_shards(self.lightning_module.state_dict()),
                "optimizers": [local_shards(optimizer.state_dict()) for optimizer in trainer.optimizers],
                "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]}

    def _load_peer_state(self, state: dict[str, Any]) -> None:
        rank_zero_info(f"replica group {replica_group()}: recovering with a live group's state at step "
                       f"{self.manager.current_step()}")
        trainer = self.lightning_module.trainer
        load_local_shards(self.lightning_module, state["model"])
        for optimizer, optimizer_state in zip(trainer.optimizers, state["optimizers"]):
            optimizer.load_state_dict(optimizer_state_on_mesh(optimizer, optimizer_state))
        for config, scheduler_state in zip(trainer.lr_scheduler_configs, state["schedulers"]):
            config.scheduler.load_state_dict(scheduler_state)
        follow_committed_steps(trainer, self.manager.current_step(), self.lightning_module.run_plan.accumulation)
        self.recoveries += 1

    def teardown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        super().teardown()


def follow_committed_steps(trainer: L.Trainer, step: int, accumulation: int) -> None:
    """Make Lightning's counts the committed steps: its step count (``global_step``: the schedule, checkpoints,
    max_steps, logging) and its count of training batches (when to validate): Lightning counts every optimizer step
    it ran, also one that did not commit, and a recovered group has not run the steps it took from its peer. The
    batch counters move by the difference, whatever the phase of the batch (some lag by one). The logging step is
    set as each step starts (``start_step``): a step that did not commit is logged at its own step."""
    loop = trainer.fit_loop.epoch_loop
    batches = loop.batch_progress.total
    shift = (step - trainer.global_step) * accumulation
    batches.ready, batches.started = batches.ready + shift, batches.started + shift
    batches.processed, batches.completed = batches.processed + shift, batches.completed + shift
    progress = loop.automatic_optimization.optim_progress.optimizer.step.total
    progress.ready = progress.completed = step
    for config in trainer.lr_scheduler_configs:  # LambdaLR and its kin compute the rate from last_epoch
        config.scheduler.last_epoch = step - 1
        with warnings.catch_warnings():  # torch's warning that no optimizer step came first: none is meant to
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            config.scheduler.step()


class CommittedSteps(Callback):
    """At the end of each optimizer step, Lightning's step count set to the committed steps, and the quorum, commits
    and recoveries logged; at the end of training, the job told that it has finished."""

    def __init__(self, strategy: FaultTolerantStrategy) -> None:
        self.strategy = strategy
        self.failed_commits = 0
        # the manager's count of committed steps and replica batches: where the stream goes on (a resumed job's)
        self.restored = {"step": 0, "batches_committed": 0}

    def state_dict(self) -> dict[str, int]:
        return self.strategy.manager.state_dict()

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.restored = dict(state_dict)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        plan = pl_module.run_plan
        if not plan.ends_optimizer_step(batch_idx):
            return
        manager = self.strategy.manager
        committed = manager.current_step()
        if committed != trainer.global_step:  # the step did not commit: Lightning counted it all the same
            self.failed_commits += 1
            follow_committed_steps(trainer, committed, plan.accumulation)
        quorum = manager.num_participants()
        pl_module.log_dict({"fault_tolerance/quorum_size": float(quorum),
                            "fault_tolerance/samples_per_group": float(plan.global_batch_size // max(quorum, 1)),
                            "fault_tolerance/failed_commits": float(self.failed_commits),
                            "fault_tolerance/recoveries": float(self.strategy.recoveries),
                            "fault_tolerance/quorum_seconds": self.strategy.quorum_seconds})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.strategy.job_store is not None:
            self.strategy.job_store.set(JOB_FINISHED, str(trainer.global_step))


def weights_only_http_transport(timeout: timedelta) -> Any:
    """torchft's HTTP transport of a recovering group's state, read with torch's weights-only unpickler: a peer's
    state is data, and torchft's own reader would run any code its pickle asks for."""
    from torchft.checkpointing import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as response, \
                    warnings.catch_warnings():  # torch's note that the received bytes back read-only tensors
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                return _streaming_load(response, weights_only=True)

    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)
