"""Bad optimizer steps: a NaN or inf loss or gradient on any rank, or optionally a loss spike, handled the same way
on every rank.

At each optimizer step, after backward and before the update, every rank puts "is my loss or any of my gradients
non-finite" and its loss into one small vector, and one all-reduce gives every rank every rank's answer. The
verdict stays on the device: a bad step is handed to the fused optimizer as its ``found_inf``, the flag torch's
grad scaler uses, so the update (weights, moments and step count) is skipped on all ranks without the host waiting
for the device. The host reads the verdict one step later, when the device is long done with it, and then acts as
configured:

- ``stop``: end the run with one line naming the step and the ranks; the newest checkpoint, written before the bad
  update (which never happened), is kept;
- ``skip``: go on without that update, counting skipped steps; stop after ``patience`` bad steps in a row;
- ``rollback``: reload weights and optimizer state from the newest checkpoint and go on with the next data (the
  window that caused it is not seen again); stop after ``patience`` rollbacks to the same checkpoint.

A loss spike is a step whose loss (mean over ranks) lies more than ``spike_zscore`` standard deviations above the
mean of the last ``spike_window`` good steps, as OLMo's skip-step optimizer decides; off unless configured.
Under fp16's grad scaler, non-finite gradients are routine (the scaler searches its loss scale with them and skips
those steps itself), so there only the loss is checked.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from app.safety.checkpoint_reading import load_training_state
from app.safety.checkpoint_writing import RunCheckpoint
from core.errors import UserError, check_ranges
from core.run_plan import run_plan_of
from models.module import CohortModule
from models.parallel.parallelize import GradientNorms

Action = Literal["stop", "skip", "rollback"]
MIN_SPIKE_HISTORY = 20  # good steps seen before a z-score means anything


class BadStepGuard(Callback):
    def __init__(self, action: Action = "stop", patience: int = 5, spike_zscore: float | None = None,
                 spike_window: int = 100) -> None:
        """
        Args:
            action: what all ranks do after a step with a NaN or inf loss or gradient: stop, skip or rollback.
            patience: skip: stop after this many bad steps in a row; rollback: stop after this many rollbacks to
                the same checkpoint.
            spike_zscore: also treat a loss this many standard deviations above the recent mean as bad (OLMo
                uses 6); null: only NaN and inf are bad.
            spike_window: the number of recent good steps whose losses give that mean and deviation.
        """
        check_ranges("bad_steps", {
            "patience": (patience >= 1, ">= 1"),
            "spike_zscore": (spike_zscore is None or spike_zscore > 0, "> 0, or null to leave spikes alone"),
            "spike_window": (spike_window >= MIN_SPIKE_HISTORY, f">= {MIN_SPIKE_HISTORY}"),
        }, locals())
        self.action = action
        self.patience = patience
        self.spike_zscore = spike_zscore
        self.spike_window = spike_window
        self.skipped_steps = 0  # bad steps over the whole run, resumed runs included
        self.bad_in_a_row = 0
        self.rollbacks_to_target = 0  # rollbacks in a row to the same checkpoint
        self.rollback_target = ""
        self._recent_losses = torch.full((spike_window,), float("nan"))  # good steps' losses, a ring by step
        self._step_loss = torch.zeros(())  # this step's micro-batch losses as backward gets them (Lightning divides
        # each by the accumulation; under 16-mixed they are also multiplied by the loss scale)
        self._unread: list[tuple[int, torch.Tensor, torch.cuda.Event | None]] = []  # (step, verdict, copied)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.spike_zscore is not None and grad_scaler(trainer) is not None:
            raise UserError("bad_steps.spike_zscore does not work with precision 16-mixed, whose grad scaler skips "
                            "steps by itself: use bf16-mixed, or set bad_steps.spike_zscore null")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._recent_losses = self._recent_losses.to(pl_module.device)
        self._step_loss = torch.zeros((), device=pl_module.device)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._step_loss += loss.detach().float()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        """After the step's last backward, before clipping and the update: one all-reduce, one verdict on every
        rank, and a bad step's update skipped."""
        # an asynchronous run's server judges each worker's gradient alone, as it applies it
        asynchronous = run_plan_of(trainer.lightning_module).asynchronous
        world, rank = (1, 0) if asynchronous else (trainer.world_size, trainer.global_rank)
        scaled = grad_scaler(trainer) is not None
        finite = torch.isfinite(self._step_loss)
        if not scaled:
            finite &= gradient_norms(pl_module, optimizer).finite_here().to(finite.device)
        report = torch.zeros(world + 1, device=finite.device)  # each rank's "bad" flag, then the summed losses
        report[rank] = (~finite).float()
        report[world] = torch.where(finite, self._step_loss, 0.0)
        if world > 1:
            dist.all_reduce(report)
        self._step_loss.zero_()
        bad_ranks = report[:world] > 0
        bad = bad_ranks.any()
        if self.spike_zscore is not None:
            bad = bad | self._spike(report[world] / world, bad, trainer.global_step)
        # under the grad scaler, which sets found_inf itself, a non-finite loss leaves non-finite gradients it skips
        if not scaled and getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.found_inf = bad.float()  # torch's fused Adam/AdamW skip the whole update on this flag
        elif not scaled and bad.item():  # an optimizer that cannot skip on the device's word: the host decides now
            optimizer.zero_grad(set_to_none=True)
        self._unread.append((trainer.global_step + 1, *copy_to_host(torch.cat([bad_ranks, bad.view(1)]))))

    def _spike(self, loss: torch.Tensor, bad: torch.Tensor, step: int) -> torch.Tensor:
        """Whether ``loss`` lies ``spike_zscore`` deviations above the recent good losses; a good loss joins them."""
        # masked sums rather than indexing out the empty slots: a data-dependent shape would make the host wait
        filled = ~torch.isnan(self._recent_losses)
        count = filled.sum()
        mean = torch.where(filled, self._recent_losses, 0.0).sum() / count.clamp(min=1)
        variance = torch.where(filled, self._recent_losses - mean, 0.0).square().sum() / (count - 1).clamp(min=1)
        spike = (count >= MIN_SPIKE_HISTORY) & (loss > mean + self.spike_zscore * variance.sqrt().clamp(min=1e-6))
        slot = step % self.spike_window
        self._recent_losses[slot] = torch.where(bad | spike, self._recent_losses[slot], loss)
        return spike

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if run_plan_of(pl_module).ends_optimizer_step(batch_idx):
            self._act(trainer, keep_newest=True)
            if self.skipped_steps:  # each self.log costs about a millisecond: only once there is something to say
                pl_module.log("train/skipped_steps", float(self.skipped_steps))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._act(trainer, keep_newest=False)

    def _act(self, trainer: L.Trainer, keep_newest: bool) -> None:
        """Act on the verdicts the host has not read yet; with ``keep_newest``, the step just taken waits until
        the next call, so that reading it never makes the host wait for the device."""
        while len(self._unread) > (1 if keep_newest else 0):
            step, verdict, copied = self._unread.pop(0)
            if copied is not None:
                copied.synchronize()
            *rank_flags, bad = verdict.tolist()
            if not bad:
                self.bad_in_a_row = 0
                continue
            self.skipped_steps += 1
            self.bad_in_a_row += 1
            ranks = [str(rank) for rank, flag in enumerate(rank_flags) if flag]
            what = (f"step {step}: the loss or gradients were NaN or inf on rank {', '.join(ranks)} of "
                    f"{trainer.world_size}" if ranks else f"step {step}: the loss spiked above "
                    f"{self.spike_zscore} standard deviations of the last {self.spike_window} steps")
            if self.action == "rollback":
                self._rollback(trainer, what)
            elif self.action == "skip" and self.bad_in_a_row < self.patience:
                rank_zero_info(f"bad steps: {what}; its update was skipped on every rank ({self.skipped_steps} skipped so far)")
            else:
                in_a_row = f" ({self.bad_in_a_row} bad steps in a row)" if self.action == "skip" else ""
                raise UserError(f"{what}{in_a_row}, so training stopped without its update; {kept(trainer)}, or "
                                "set bad_steps.action to skip or rollback")

    def _rollback(self, trainer: L.Trainer, what: str) -> None:
        callback = trainer.checkpoint_callback
        if isinstance(callback, RunCheckpoint):
            callback.finish_pending_save(trainer)  # the newest may still be being written (checkpoint.async_save)
        last = callback.last_model_path if callback else ""
        if not last:
            raise UserError(f"{what}, and no checkpoint was written yet to roll back to: lower "
                            "checkpoint.every_n_train_steps or model.optimizer.learning_rate, or set bad_steps.action skip")
        target = os.path.realpath(last)
        self.rollbacks_to_target = self.rollbacks_to_target + 1 if target == self.rollback_target else 1
        self.rollback_target = target
        if self.rollbacks_to_target > self.patience:
            raise UserError(f"{what}, after {self.patience} rollbacks to {target}; training stopped: "
                            f"{kept(trainer)}")
        load_training_state(trainer, target)
        rank_zero_info(f"bad steps: {what}; rolled back every rank to {target} and going on with the next data "
                       f"(rollback {self.rollbacks_to_target} to it)")

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "bad_in_a_row": self.bad_in_a_row,
                "rollbacks_to_target": self.rollbacks_to_target, "rollback_target": self.rollback_target,
                "recent_losses": self._recent_losses.cpu()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = state_dict["skipped_steps"]
        self.bad_in_a_row = state_dict["bad_in_a_row"]
        self.rollbacks_to_target = state_dict["rollbacks_to_target"]
        self.rollback_target = state_dict["rollback_target"]
        if state_dict["recent_losses"].numel() == self.spike_window:  # else the window was resized: start afresh
            self._recent_losses = state_dict["recent_losses"]


def grad_scaler(trainer: L.Trainer) -> torch.amp.GradScaler | None:
    """fp16's loss scaler, under 16-mixed on GPUs; None otherwise."""
    return getattr(trainer.precision_plugin, "scaler", None)


def gradient_norms(pl_module: L.LightningModule, optimizer: torch.optim.Optimizer) -> GradientNorms:
    """The step's gradient norms: a Cohort family's, which clipping reads again (one pass over the gradients), or
    taken here for any other LightningModule."""
    if isinstance(pl_module, CohortModule):
        return pl_module.gradient_norms(optimizer)
    return GradientNorms(param.grad for group in optimizer.param_groups for param in group["params"]
                         if param.grad is not None)


def copy_to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying a small device tensor to the host without waiting; the event says when it has arrived."""
    if tensor.device.type != "cuda":
        return tensor.cpu(), None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


def kept(trainer: L.Trainer) -> str:
    """Which checkpoint holds the newest good state, and what to do, for a message."""
    callback = trainer.checkpoint_callback
    if not isinstance(callback, RunCheckpoint) or not callback.last_model_path:
        return "no checkpoint was written yet: lower model.optimizer.learning_rate or set trainer.gradient_clip_val and start again"
    kept, resume = callback.kept_and_resume(trainer)
    return (f"{kept}, the newest good checkpoint: lower model.optimizer.learning_rate or set trainer.gradient_clip_val and "
            f"resume with {resume}")
