"""Local SGD and DiLoCo: DDP ranks that step their own optimizer and meet every ``sync_every`` (H) optimizer steps,
chosen in the config (``local_updates.method``). All-reduces per optimizer step drop from one (the gradient's) to
one every H steps (the parameters', or the pseudo-gradient's, of the same size):

    sync       DDP as it is: the gradient all-reduced at every step (the default)
    local_sgd  each rank runs Cohort's AdamW on its own micro-batches' gradient; every H steps the parameters are
               averaged over the ranks (local SGD, Stich 2019), by torch.distributed.algorithms.model_averaging
    diloco     the same inner AdamW steps; every H steps an outer step (DiLoCo, Douillard et al. 2023): the
               pseudo-gradient, the parameters at the last sync less the current ones, averaged over the ranks in
               one all-reduce, moves the synced parameters by Nesterov SGD (the paper's outer lr 0.7, momentum 0.9),
               and every rank loads them

The batch plan and the learning-rate schedule keep their meaning: a step still reads one global batch, each rank its
own share, and the inner schedule advances once per optimizer step; what changes is that a rank's update uses only
its own micro-batches' gradient. Gradients are clipped per rank, by the rank's own norm (train/grad_norm is rank 0's).

local_sgd with H = 1 is DDP: the gradient is all-reduced at every step and nothing is averaged. Averaging the
parameters after each rank's own AdamW step is not one AdamW step on the averaged gradient (Adam divides each
gradient by a running RMS that would see only that rank's gradients, and clipping would use local norms), so "local
SGD with H = 1" would train another, worse model for the same bytes; torch's PeriodicModelAverager warns likewise
for period 1. DiLoCo with H = 1 stays DiLoCo (an outer step after every inner one).

How. DDP keeps its forward and backward (buffers, Lightning's accumulation, the monitor's marker at each backward's
end); Cohort's one DDP comm hook (app/strategies/gradient_compression.py) returns each rank's own gradient instead of
all-reducing it, as torch's post_localSGD_hook does past its start step. DDP's no_sync would do the same, but only if
every micro-batch of Lightning's loop ran inside it. The sync runs in a post-step hook of the inner optimizer
(torch's ``Optimizer.register_step_post_hook``), right after the update and before any callback sees the step, so
checkpoints, the monitor's replica check and comm/bytes_per_step see the step as it ended. Lightning's
``DDPStrategy(model_averaging_period=...)`` does the local SGD part only on CUDA: it averages only under a
PostLocalSGDState comm state, which ``DDPStrategy._register_ddp_hooks`` (lightning/pytorch/strategies/ddp.py)
registers only when the root device is CUDA; on CPUs (gloo) it would silently average nothing and all-reduce every
gradient. torchft's DiLoCo runs behind its Manager, which needs a lighthouse server process for its quorum: a service
that a job under torchrun or srun does not have. The algorithm is one all-reduce and an SGD step, so it is written
here on torch.distributed, with torch's own averaging function.

Resume. The checkpoint holds the steps since the last sync, DiLoCo's synced parameters and outer momentum (by
parameter name, as tensors), and every rank's own parameters and AdamW moments (gathered to rank 0: Lightning saves
rank 0's alone, and between syncs each rank's differ). ``--ckpt_path last`` gives each rank back its own, so a
resumed run trains bitwise as the uninterrupted one; the price is world size x 3 x the weights in each checkpoint.
A run whose max_steps or val_every_n_steps is not a multiple of H ends or validates between syncs, on each rank's
own weights (the pre-flight checks say so); its last checkpoint's weights are then rank 0's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState
from torch.distributed.algorithms.model_averaging.utils import average_parameters, get_params_to_average

from app.safety.optimizer_state_keys import parameter_names
from app.strategies.gradient_compression import CompressionSettings, gather_per_rank, registered_compression
from app.strategies.kind import ConfiguredStrategy, StrategyKind
from core.errors import UserError, check_ranges
from core.run_plan import RunPlan

UPDATE_METHODS = ("sync", "local_sgd", "diloco")
SyncListener = Callable[[bool], None]  # called with True as a sync starts, False once every rank holds its result


@dataclass(frozen=True)
class LocalUpdateSettings:
    """The config's ``local_updates`` group: LocalUpdates' arguments (its docstring, which --help shows, says each),
    refused in one line where they are unknown or out of range."""

    method: str = "sync"
    sync_every: int = 8
    outer_learning_rate: float = 0.7
    outer_momentum: float = 0.9

    def __post_init__(self) -> None:
        if self.method == "sync":
            return
        field = "local_updates"
        if self.method not in UPDATE_METHODS:
            raise UserError(f"{field}.method={self.method!r} is not an update method: use one of "
                            f"{', '.join(UPDATE_METHODS)}")
        check_ranges(field, {"sync_every": (self.sync_every >= 1, "at least 1"),
                             "outer_learning_rate": (self.outer_learning_rate > 0, "> 0"),
                             "outer_momentum": (0 <= self.outer_momentum < 1, "in [0, 1)")}, vars(self))


def check_config(settings: LocalUpdateSettings, plan: RunPlan, strategy: ConfiguredStrategy,
                 compression: CompressionSettings, bad_steps_action: str | None, max_steps: int | None,
                 val_every_n_steps: int | None) -> None:
    """A UserError for local updates outside DDP or combined with what they cannot work with (gradient compression,
    a rollback on bad steps); notes where they do nothing, or where the run ends or validates between two syncs."""
    method, field = settings.method, "local_updates"
    if method == "sync":
        return
    if strategy.kind is not StrategyKind.DDP:
        raise UserError(f"{field}.method={method} lets each DDP replica step on its own, but trainer.strategy is "
                        f"{strategy.name}, whose ranks hold shards, not replicas: use a DDP preset "
                        "(configs/trainer/diloco_cpu.yaml, ddp_cpu.yaml, ddp_gpu_bf16.yaml) or set "
                        f"{field}.method sync")
    if method == "local_sgd" and settings.sync_every == 1:
        rank_zero_info(f"{field}: local_sgd with sync_every 1 is DDP (gradients all-reduced at every step): "
                       "averaging parameters after each rank's own AdamW step would send as much and train worse")
        return
    if compression.method != "none":
        raise UserError(f"{field}.method={method} all-reduces no gradients, so gradient_compression.method="
                        f"{compression.method} would have nothing to compress: set gradient_compression.method none, "
                        f"or {field}.method sync")
    if bad_steps_action == "rollback":
        raise UserError(f"bad_steps.action=rollback reloads rank 0's weights and optimizer state into every rank, "
                        f"which under {field}.method={method} would drop each rank's own: use stop or skip")
    if plan.world_size == 1:
        rank_zero_info(f"{field}: method {method} does nothing on one process (there is nothing to sync); the run "
                       "trains as plain AdamW")
        return
    between = [f"{name}={value}" for name, value in (("trainer.max_steps", max_steps),
                                                     ("val_every_n_steps", val_every_n_steps))
               if value is not None and value > 0 and value % settings.sync_every]
    if between:
        rank_zero_info(f"{field}: {' and '.join(between)} not a multiple of sync_every={settings.sync_every}: the "
                       "run ends or validates between two syncs, on each rank's own weights (the last checkpoint's "
                       "weights are then rank 0's)")


class LocalUpdates(Callback):
    def __init__(self, method: str = LocalUpdateSettings.method, sync_every: int = LocalUpdateSettings.sync_every,
                 outer_learning_rate: float = LocalUpdateSettings.outer_learning_rate,
                 outer_momentum: float = LocalUpdateSettings.outer_momentum) -> None:
        """
        Args:
            method: sync (DDP), local_sgd or diloco (the pre-flight checks refuse others, and local updates outside
                DDP or with gradient compression).
            sync_every: H, optimizer steps between two syncs; all-reduces per step drop to 1/H.
            outer_learning_rate: DiLoCo's outer learning rate (> 0; 1 with momentum 0 is local SGD's averaging).
            outer_momentum: DiLoCo's outer Nesterov momentum, in [0, 1).
        """
        self.method = method
        self.sync_every = sync_every
        self.outer_learning_rate = outer_learning_rate
        self.outer_momentum = outer_momentum
        self.sync_listeners: list[SyncListener] = []  # the monitor's: a sync's time is sync wait, not compute
        self.active = False  # set at train start: ranks step on their own gradients
        self.steps_since_sync = 0
        self.syncs = 0
        self._params: list[torch.nn.Parameter] = []  # the inner optimizer's, in its order
        self._synced: list[torch.Tensor] = []  # DiLoCo: the parameters at the last sync, which the outer step moves
        self._outer: torch.optim.SGD | None = None
        self._loaded: dict[str, Any] = {}  # what the checkpoint held, until train start

    # ----- setup: after Lightning has restored the optimizer, before the first backward -----
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        one_step_is_ddp = self.method == "local_sgd" and self.sync_every == 1
        if (self.method == "sync" or one_step_is_ddp or not isinstance(trainer.strategy, DDPStrategy)
                or trainer.world_size == 1):
            return  # DDP itself; the pre-flight checks refused other strategies and noted a single process
        compression = registered_compression(trainer)
        if compression is None:
            raise UserError(f"local_updates.method={self.method}: another DDP comm hook is registered "
                            "(trainer.strategy.init_args.ddp_comm_hook?) and would all-reduce every gradient: remove it")
        compression.local_gradients = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=0,
                                                        post_local_gradient_allreduce=False)
        self._compression = compression
        optimizer = trainer.optimizers[0]  # Cohort's one AdamW
        self._optimizer = optimizer
        self._names = parameter_names(pl_module)
        self._params = [param for group in optimizer.param_groups for param in group["params"]]
        if self.method == "diloco":
            self._synced = [param.detach().clone() for param in self._params]  # equal on every rank: DDP broadcast
            self._outer = torch.optim.SGD(self._synced, lr=self.outer_learning_rate, momentum=self.outer_momentum,
                                          nesterov=self.outer_momentum > 0)
        self._restore(trainer.global_rank, trainer.world_size)
        self._hook = optimizer.register_step_post_hook(self._after_inner_step)
        self.active = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.active:
            self._hook.remove()
            rank_zero_info(f"local updates {self.method}: {self.syncs} syncs, one every {self.sync_every} optimizer "
                           f"steps; {self.steps_since_sync} steps since the last")

    # ----- the sync, every sync_every inner steps -----
    @torch.no_grad()
    def _after_inner_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.steps_since_sync += 1
        if self.steps_since_sync < self.sync_every:
            return
        for listener in self.sync_listeners:
            listener(True)
        if self.method == "local_sgd":
            averaged = get_params_to_average(optimizer.param_groups)  # those with a gradient, as torch's averagers
            average_parameters(iter(averaged), dist.group.WORLD)  # one all-reduce of them all, flattened
        else:
            averaged = [synced - param for synced, param in zip(self._synced, self._params)]  # pseudo-gradients
            average_parameters(iter(averaged), dist.group.WORLD)
            for synced, pseudo_gradient in zip(self._synced, averaged):
                synced.grad = pseudo_gradient
            self._outer.step()
            for param, synced in zip(self._params, self._synced):
                param.copy_(synced)
        for listener in self.sync_listeners:
            listener(False)
        self._compression.count_sent(sum(tensor.numel() * tensor.element_size() for tensor in averaged))
        self.steps_since_sync = 0
        self.syncs += 1

    def replicas_differ(self) -> bool:
        """Whether the ranks' weights may differ now: between two syncs."""
        return self.active and self.steps_since_sync != 0

    # ----- checkpoint: tensors, numbers and names only (loadable with weights_only=True) -----
    def state_dict(self) -> dict[str, Any]:
        """The round's position, DiLoCo's outer state and every rank's own weights and AdamW moments; a collective
        (gather to rank 0), which every rank reaches: Lightning builds the checkpoint on every rank."""
        if not self.active:
            return {}
        own = {}
        for param in self._params:
            name = self._names[id(param)]
            own[f"weights/{name}"] = param.detach()
            for key, value in self._optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:  # exp_avg, exp_avg_sq; not the step count
                    own[f"{key}/{name}"] = value
        state: dict[str, Any] = {"method": self.method, "sync_every": self.sync_every,
                                 "steps_since_sync": self.steps_since_sync, "syncs": self.syncs,
                                 "ranks": gather_per_rank(own)}
        if self._outer is not None:
            state["synced"] = {self._names[id(param)]: synced.cpu() for param, synced in zip(self._params, self._synced)}
            state["outer_momentum"] = {self._names[id(param)]: self._outer.state[synced]["momentum_buffer"].cpu()
                                       for param, synced in zip(self._params, self._synced)
                                       if self._outer.state[synced].get("momentum_buffer") is not None}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict  # applied at train start, once the optimizer holds what Lightning restored

    @torch.no_grad()
    def _restore(self, rank: int, world_size: int) -> None:
        saved = self._loaded
        if not saved:
            return
        if saved.get("method") != self.method:
            rank_zero_info(f"local updates: the checkpoint was trained with {saved.get('method', 'sync')}, not "
                           f"{self.method}: the first round starts now, from rank 0's weights")
            return
        self.steps_since_sync, self.syncs = saved["steps_since_sync"], saved["syncs"]
        ranks = saved["ranks"]
        if len(ranks) == world_size:
            own = ranks[rank]
            for param in self._params:
                name = self._names[id(param)]
                param.copy_(own[f"weights/{name}"])
                for key, value in self._optimizer.state.get(param, {}).items():
                    if f"{key}/{name}" in own:
                        value.copy_(own[f"{key}/{name}"])
        else:
            rank_zero_info(f"local updates: the checkpoint holds the weights of {len(ranks)} ranks, not {world_size}: "
                           "every rank goes on from rank 0's")
        for param, synced in zip(self._params, self._synced):  # DiLoCo
            name = self._names[id(param)]
            synced.copy_(saved["synced"][name])
            if name in saved["outer_momentum"]:
                self._outer.state[synced]["momentum_buffer"] = saved["outer_momentum"][name].to(synced).clone()
