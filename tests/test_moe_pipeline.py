"""The mixture of experts in pipeline stages trains as one process does: each stage's routers' balance loss reaches
the training loss through that stage's own backward (models/parallel/pipeline.py AddedLossGradient), with the
weight one process gives it, under 1F1B and under a zero-bubble schedule, whose backward is split in two; and the
routing statistics the monitor logs, counted on each stage, are the one process's.

The balance loss weighs 1.0 here (0.01 by default), so that a stage whose balance gradient went missing, or counted
twice, would change the gradient norm far beyond the float32 rounding the comparison allows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models.routed_experts import MoEFeedForward
from tests.helpers import fit, fit_in_process, scalars
from tests.test_pipeline import assert_trains_as_one_process_does, schedule

pytestmark = pytest.mark.slow

MOE = ["--model.class_path", "models.moe.family.MoELanguageModel", "--model.load_balance_coefficient", "1.0"]
SMALL = ["--model.model_name", "small", "--data.sequence_length", "64"]  # 4 blocks: a V of 2 stages per rank


def smallest_router_gap(run: Callable[[], object]) -> float:
    """Runs ``run`` and returns the smallest gap, over every token any router saw in training, between the
    probability of the last expert a token chose and of the best one it did not choose."""
    gaps: list[float] = []
    forward = MoEFeedForward.forward

    def recording(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
        if layer.training and not x.is_meta:  # not the FLOP count on the meta device
            probabilities = F.linear(x.float(), layer.router.weight.float()).softmax(dim=-1)
            top = probabilities.topk(layer.top_k + 1, dim=-1).values
            gaps.append(float((top[..., -2] - top[..., -1]).min()))
        return forward(layer, x)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MoEFeedForward, "forward", recording)
        run()
    return min(gaps)


@pytest.mark.parametrize("layout", ["1F1B", "ZBVZeroBubble"])
def test_the_mixture_of_experts_in_pipeline_stages_trains_as_one_process_does(
        tmp_path: Path, comparable_run_args: list[str], layout: str) -> None:
    """Routing is discrete, and a pipeline computes the routers' logits in other matrix shapes (one sample per
    pipeline micro-batch), so float32 rounds them differently: by at most 6e-8 of a probability on the small size's
    deeper layers (measured for whole micro-batches against their samples one by one; 0 on the debug size). No
    choice can flip while every token's gap, between the probability of the last expert it chose and of the best one
    it did not, stays well above that: the smallest gap of the one-process run is measured and must be 1e-6 or more
    (this seed's: 2.5e-6 for the debug size over its 4 steps, 4.1e-6 for the small one; a seed with a nearer tie
    fails here instead of flaking below). Then every step's losses and gradient norm within 1e-5 and the weights
    within what AdamW allows for reordered sums, as for the dense families."""
    size = [] if layout == "1F1B" else SMALL
    args = [*comparable_run_args, *MOE, *size]
    one_process = tmp_path / "one_process"
    gap = smallest_router_gap(lambda: fit_in_process(one_process, args))
    assert gap >= 1e-6, f"a near-tie in the router ({gap:.2e}): choose another seed for this test"
    pipelined = fit(tmp_path / layout, args, *(schedule("1F1B", 4) if layout == "1F1B" else
                                               schedule("ZBVZeroBubble", 4)))
    assert_trains_as_one_process_does(one_process, pipelined)
    # every choice alike: the token choices per expert, logged per step from every stage's pipeline micro-batches
    # (app/observability/routing.py), are the one process's, count for count
    layers = 2 if layout == "1F1B" else 4
    for tag in ("moe/load_min", "moe/load_median", "moe/load_max", *(f"moe/imbalance/layer{layer}"
                                                                     for layer in range(layers))):
        assert scalars(pipelined, tag) == scalars(one_process, tag), tag
