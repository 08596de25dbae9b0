"""How evenly a mixture of experts' routers spread the tokens over the experts, and how many token choices they
dropped, per optimizer step over every rank: in TensorBoard and in the run summary. The monitor
(app/observability/monitor.py) keeps an ``ExpertLoad`` where the network has routed-expert layers
(models/routed_experts.py's MoEFeedForward); a network without them logs none of this.

Each MoE layer keeps what its last forward routed: the token choices per expert, before capacity drops any, and the
dropped ones. After every training micro-batch they are added up on the device, into a (layers, experts) tensor, so
no micro-batch waits for the device (under activation checkpointing the recomputed forward routes the same tokens
alike and leaves the same counts). Under a pipeline a stage runs a micro-batch in pipeline micro-batches, each
leaving its own counts: they are added after each stage forward instead (a forward hook on the stage: the blocks'
recomputation runs inside it, not as another). On the steps the logger writes, one all-reduce of that tensor sums it over the
ranks and the host reads it once; the other steps' sums are dropped, costing no collective. Every rank takes part in
the same all-reduces: the logger's steps are counted alike on every rank, and a stop that adds one (preemption) is
agreed between them first.

The all-reduce is over all ranks. Each rank fills the rows of the layers it holds (every layer, or under a pipeline its
stages' layers, by their place in the whole network) and leaves the others zero, so the sum counts each layer once per
data-parallel rank. Tensor-parallel ranks of one data-parallel rank route the same tokens (their activations are
replicated), so the sum counts each choice tensor_parallel_size times: it is divided by that. Under expert parallelism each
rank still counts its own tokens' choices for all experts, before they travel to their experts' ranks.

Logged per optimizer step, from the token choices of every micro-batch of every data-parallel rank:
- moe/load_min, moe/load_median, moe/load_max: token choices per expert, over the experts of every layer. An even
  router gives each expert tokens x top_k / experts; a min of 0 is an expert that no token chose (a dead expert).
- moe/imbalance: the most chosen expert's choices over the mean (the even share) in the worst layer: 1 is even, 2
  an expert with twice its share, which computes twice as long (under expert parallelism, the rank all others
  wait for) and which a capacity_factor below 2 cuts. moe/imbalance/layer<L>: each layer's.
- moe/dropped_share: the share of the token choices dropped beyond an expert's capacity, over all layers (0 without
  a capacity_factor); with one, moe/dropped_share/layer<L> too.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn

from core.run_plan import RunPlan
from models.parallel.parallelize import CHECKPOINT_WRAPPER_PREFIX
from models.parallel.pipeline import TimedStage
from models.routed_experts import MoEFeedForward

IMBALANCE = "moe/imbalance"
DROPPED_SHARE = "moe/dropped_share"


class ExpertLoad:
    """The token choices per expert and the dropped ones of the optimizer step under way, summed on the device over
    its micro-batches, and what the logged steps held, for the run summary."""

    def __init__(self, layers: dict[int, MoEFeedForward], network_layers: int, tensor_parallel_size: int,
                 stages: list[TimedStage] | None = None) -> None:
        """``layers``: the MoE layers this rank holds, by their place among the ``network_layers`` of the whole
        network (all of them but under a pipeline); ``stages``: the pipeline stages this rank runs, if any, whose
        forwards are counted."""
        self.layers = layers
        self.tensor_parallel_size = tensor_parallel_size
        some = next(iter(layers.values()))
        self.shape = (network_layers, some.router.weight.shape[0])  # every layer of the network, on every rank
        # whether a layer may drop choices: then each layer's dropped share is logged and charted too
        self.drops = some.capacity_factor is not None
        self.chosen: torch.Tensor | None = None  # (layers, experts) this step's token choices so far
        self.dropped: torch.Tensor | None = None  # (layers,) this step's dropped choices so far
        self.stages = stages
        for stage in stages or []:  # the stage's forward wrapped, as the pipeline wraps it, counting its layers
            held = {id(layer) for layer in moe_layer_names(stage.submod).values()}
            indices = [index for index, layer in layers.items() if id(layer) in held]
            stage.submod.forward = partial(self._count_stage_forward, stage, indices, stage.submod.forward)
        self.logged_imbalance: list[tuple[int, float]] = []  # (step, moe/imbalance) of each logged step
        self.logged_choices = self.logged_dropped = 0  # token choices and dropped ones of the logged steps

    @classmethod
    def of(cls, pl_module: L.LightningModule, plan: RunPlan) -> ExpertLoad | None:
        """The statistics of the module's MoE layers; None for a network without any."""
        network = getattr(pl_module, "model", None) or pl_module
        held = moe_layer_names(network)
        if not held:
            return None
        pipeline = getattr(pl_module, "pipeline", None)
        everywhere = list(held)
        if pipeline is not None:  # a pipeline rank holds only its stages' layers: the whole network's, in order
            with torch.device("meta"):
                everywhere = list(moe_layer_names(pl_module.plain_network()))
        return cls({everywhere.index(name): layer for name, layer in held.items()}, len(everywhere),
                   plan.tensor_parallel_size, pipeline.stages if pipeline is not None else None)

    def _count_stage_forward(self, stage: TimedStage, indices: list[int], run: Callable[..., torch.Tensor],
                             *inputs: Any) -> torch.Tensor:
        """A pipeline stage's forward; of a pipeline micro-batch in training (not of evaluation, nor of torch's
        metadata inference, on uninitialised inputs), the counts of its layers (at ``indices``) are added."""
        outputs = run(*inputs)
        if stage.forwarding_chunk and torch.is_grad_enabled():
            self._add(indices)
        return outputs

    def _add(self, indices: Any) -> None:
        """Add the last forward's counts of the layers at ``indices`` to the step's sums."""
        for index in indices:
            layer = self.layers[index]
            if self.chosen is None:
                self.chosen = torch.zeros(self.shape, dtype=torch.long, device=layer.tokens_per_expert.device)
                self.dropped = torch.zeros(self.shape[0], dtype=torch.long, device=layer.tokens_per_expert.device)
            self.chosen[index] += layer.tokens_per_expert
            self.dropped[index] += layer.dropped_tokens

    def after_micro_batch(self, trainer: L.Trainer, ends_step: bool) -> None:
        """Add the training micro-batch just run to the step's sums (under a pipeline, its stages' forwards have);
        at the step's end, on the steps the logger writes, sum them over the ranks (a collective) and rank 0 logs
        the step's statistics."""
        if self.stages is None:
            self._add(self.layers)
        if not ends_step:
            return
        if trainer._logger_connector.should_update_logs:
            metrics = self.step_metrics(trainer.global_step)
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)
        self.chosen = self.dropped = None

    def step_metrics(self, step: int) -> dict[str, float]:
        """The step's statistics over every rank, which must all call this on the same steps."""
        sums = torch.cat([self.chosen, self.dropped.unsqueeze(1)], dim=1)  # one tensor: one all-reduce
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
        sums = (sums // self.tensor_parallel_size).cpu()  # exact: the tensor-parallel ranks' counts are equal
        chosen, dropped = sums[:, :-1], sums[:, -1]
        self.logged_choices += int(chosen.sum())
        self.logged_dropped += int(dropped.sum())
        metrics = step_statistics(chosen, dropped, per_layer_drops=self.drops)
        self.logged_imbalance.append((step, metrics[IMBALANCE]))
        return metrics

    def charts(self) -> dict[str, dict[str, list[Any]]]:
        """Their CUSTOM SCALARS category (app/observability/tensorboard_layout.py's form)."""
        layers = r"/layer\d+$"
        return {"mixture of experts": {
            "token choices per expert — min, median, max": ["Margin", ["moe/load_median", "moe/load_min",
                                                                       "moe/load_max"]],
            "expert load imbalance (max / mean) — every layer": ["Multiline", [IMBALANCE + layers]],
            "dropped token choices (share) — " + ("every layer" if self.drops else "all layers"): [
                "Multiline", [DROPPED_SHARE + (layers if self.drops else "$")]],
        }}

    def summary_rows(self) -> list[tuple[str, str]]:
        """The run summary's lines: the imbalance at the first and the last logged step, and the dropped share of
        all the logged steps' choices."""
        if not self.logged_imbalance:
            return []
        (first_step, first), (last_step, last) = self.logged_imbalance[0], self.logged_imbalance[-1]
        return [("expert load imbalance", f"{first:.2f} at step {first_step}, {last:.2f} at step {last_step} "
                                          "(most chosen expert / mean, worst layer)"),
                ("dropped token choices",
                 f"{self.logged_dropped / self.logged_choices:.2%} of the choices in the logged steps")]


def step_statistics(chosen: torch.Tensor, dropped: torch.Tensor, per_layer_drops: bool) -> dict[str, float]:
    """TensorBoard's values of one step from its token choices per expert ``chosen`` (layers, experts) and its dropped
    choices per layer ``dropped`` (layers,), each summed over the step's micro-batches and ranks."""
    loads = chosen.double()
    imbalance = loads.max(dim=1).values / loads.mean(dim=1)  # per layer; the mean is its even share
    metrics = {"moe/load_min": loads.min().item(), "moe/load_median": statistics.median(loads.flatten().tolist()),
               "moe/load_max": loads.max().item(), IMBALANCE: imbalance.max().item(),
               DROPPED_SHARE: dropped.sum().item() / loads.sum().item()}
    metrics.update({f"{IMBALANCE}/layer{layer}": value for layer, value in enumerate(imbalance.tolist())})
    if per_layer_drops:
        shares = dropped.double() / loads.sum(dim=1)
        metrics.update({f"{DROPPED_SHARE}/layer{layer}": value for layer, value in enumerate(shares.tolist())})
    return metrics


def moe_layer_names(network: nn.Module) -> dict[str, MoEFeedForward]:
    """The network's routed-expert layers by name, without activation checkpointing's wrapper in it (a pipeline
    stage's names are the whole network's)."""
    return {name.replace(CHECKPOINT_WRAPPER_PREFIX, ""): module for name, module in network.named_modules()
            if isinstance(module, MoEFeedForward)}
