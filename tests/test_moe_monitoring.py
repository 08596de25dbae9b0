"""A mixture of experts' routing in TensorBoard and the run summary (app/observability/routing.py): the token choices
per expert, the imbalance and the dropped share logged for an optimizer step are those counted by hand from what the
routers saw in every micro-batch of the step on every data-parallel rank, once per token under tensor parallelism,
and only on the steps the logger writes."""

from __future__ import annotations

import json
import logging
import re
import statistics
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from app.observability.routing import step_statistics
from models.moe.network import MOE_CONFIGS
from tests.helpers import CONFIG_DIR, DDP_2, TENSOR_PARALLEL, batch_sizes, fit, fit_in_process, scalars

DEBUG = MOE_CONFIGS["debug"]  # 2 layers of 4 experts, 2 per token
MOE_RUN = ["-c", str(CONFIG_DIR / "moe-small/pretrain.yaml"), "--model.model_name", "debug",
           "--trainer.limit_val_batches", "0", "--model.max_new_tokens", "5", "--trainer.max_steps", "3",
           "--trainer.log_every_n_steps", "2"]  # 3 steps, logged at step 2 only
RECORD = ["--trainer.callbacks+=tests.helpers.RecordRouterInputs"]
Records = list[tuple[int, torch.Tensor, torch.Tensor]]  # (layer, router input, router weight): RecordRouterInputs'


def as_logged(value: float) -> object:
    """A ratio as TensorBoard keeps it: in float32, within half a unit in its last place (2**-24 relative) of the
    float64 value, which the run and the hand count each get from one division of the same whole numbers."""
    return pytest.approx(value, rel=2**-23)


def hand_count(records: Records, capacity: int | None) -> tuple[list[list[int]], list[int]]:
    """Token choices per expert of each layer, and the choices dropped, over the recorded forwards: each token's
    top-k of the router's softmax; per sequence, an expert's choices beyond ``capacity`` (its first come first)."""
    chosen, dropped = [[0] * DEBUG.n_expert for _ in range(DEBUG.n_layer)], [0] * DEBUG.n_layer
    for layer, inputs, weight in records:
        choices = F.linear(inputs.float(), weight.float()).softmax(dim=-1).topk(DEBUG.top_k, dim=-1).indices
        for sequence in choices.tolist():  # (T, k)
            per_expert = [0] * DEBUG.n_expert
            for token in sequence:
                for expert in token:
                    per_expert[expert] += 1
            for expert, count in enumerate(per_expert):
                chosen[layer][expert] += count
                dropped[layer] += max(0, count - capacity) if capacity is not None else 0
    return chosen, dropped


def step_records(run_dir: Path, rank: int, step: int, accumulation: int) -> Records:
    """The records of optimizer step ``step`` (from 1) on ``rank``: its micro-batches' forwards, every layer each."""
    records = torch.load(run_dir / f"router_inputs_rank{rank}.pt")
    per_step = accumulation * DEBUG.n_layer
    return records[(step - 1) * per_step: step * per_step]


def assert_logged(run_dir: Path, chosen: list[list[int]], dropped: list[int]) -> None:
    """Step 2's logged statistics (the only step logged) are those of the counts: the loads exactly (whole numbers,
    or halves for the median), the ratios as_logged."""
    loads = [count for layer in chosen for count in layer]
    choices = sum(loads)
    assert scalars(run_dir, "moe/load_min") == [min(loads)]
    assert scalars(run_dir, "moe/load_median") == [statistics.median(loads)]
    assert scalars(run_dir, "moe/load_max") == [max(loads)]
    imbalance = [max(layer) / (sum(layer) / DEBUG.n_expert) for layer in chosen]
    for layer, value in enumerate(imbalance):
        assert scalars(run_dir, f"moe/imbalance/layer{layer}") == [as_logged(value)]
    assert scalars(run_dir, "moe/imbalance") == [as_logged(max(imbalance))]
    assert scalars(run_dir, "moe/dropped_share") == [as_logged(sum(dropped) / choices)]
    events = EventAccumulator(str(run_dir / "lightning_logs" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    assert [event.step for event in events.Scalars("moe/imbalance")] == [2]


def test_step_statistics_of_counts_given() -> None:
    """Layer 0 sends 6 of its 8 choices to expert 0 (3x the even share of 2) and drops 2 of them; layer 1 is even."""
    metrics = step_statistics(torch.tensor([[6, 2, 0, 0], [2, 2, 2, 2]]), torch.tensor([2, 0]), per_layer_drops=True)
    assert metrics == {"moe/load_min": 0.0, "moe/load_median": 2.0, "moe/load_max": 6.0, "moe/imbalance": 3.0,
                       "moe/imbalance/layer0": 3.0, "moe/imbalance/layer1": 1.0, "moe/dropped_share": 2 / 16,
                       "moe/dropped_share/layer0": 0.25, "moe/dropped_share/layer1": 0.0}
    # an even number of loads: the median is the mean of the middle two, (1 + 3) / 2
    assert step_statistics(torch.tensor([[1, 3], [4, 0]]), torch.tensor([0, 0]), per_layer_drops=False) == {
        "moe/load_min": 0.0, "moe/load_median": 2.0, "moe/load_max": 4.0, "moe/imbalance": 2.0,
        "moe/imbalance/layer0": 1.5, "moe/imbalance/layer1": 2.0, "moe/dropped_share": 0.0}


def test_one_process_logs_the_hand_count_of_the_steps_two_micro_batches_with_its_drops(
        tmp_path: Path, byte_corpus: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Micro-batches of 2 sequences of 64 tokens, 2 per step, capacity_factor 1: an expert takes at most
    ceil(1 x 64 x 2 / 4) = 32 choices of each sequence. Step 2's logged loads, imbalance and dropped share are the
    hand count of its two micro-batches, the run summary gives the same, and the layout charts the tags logged."""
    with caplog.at_level(logging.INFO):
        fit_in_process(tmp_path, [*MOE_RUN, "--data.data_dir", str(byte_corpus), "--data.sequence_length", "64",
                                  *batch_sizes(4, 2), "--model.capacity_factor", "1.0", *RECORD,
                                  f"--trainer.callbacks.out_dir={tmp_path}"])
    chosen, dropped = hand_count(step_records(tmp_path, rank=0, step=2, accumulation=2), capacity=32)
    assert sum(map(sum, chosen)) == DEBUG.n_layer * 2 * 2 * 64 * DEBUG.top_k  # layers x micro-batches x B x T x k
    assert sum(dropped) > 0  # the untrained routers are uneven enough to drop
    assert_logged(tmp_path, chosen, dropped)
    for layer in range(DEBUG.n_layer):
        assert scalars(tmp_path, f"moe/dropped_share/layer{layer}") == [as_logged(dropped[layer] / sum(chosen[layer]))]

    imbalance = max(max(layer) / (sum(layer) / DEBUG.n_expert) for layer in chosen)
    summary = f"{imbalance:.2f} at step 2, {imbalance:.2f} at step 2 (most chosen expert / mean, worst layer)"
    assert re.search(r"expert load imbalance +" + re.escape(summary), caplog.text), caplog.text
    share = sum(dropped) / sum(map(sum, chosen))
    assert re.search(rf"dropped token choices +{re.escape(f'{share:.2%}')} of the choices in the logged steps",
                     caplog.text)

    events = EventAccumulator(str(tmp_path / "lightning_logs" / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    layout = layout_pb2.Layout.FromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    experts = next(category for category in layout.category if category.title == "mixture of experts")
    drawn = [{tag for tag in tags if any(re.match(pattern, tag) for pattern in chart.multiline.tag)}
             for chart in experts.chart if chart.HasField("multiline")]
    assert drawn == [{"moe/imbalance/layer0", "moe/imbalance/layer1"},
                     {"moe/dropped_share/layer0", "moe/dropped_share/layer1"}]
    bands = [(s.value, s.lower, s.upper) for chart in experts.chart if chart.HasField("margin")
             for s in chart.margin.series]
    assert bands == [("moe/load_median", "moe/load_min", "moe/load_max")]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp", "tensor_parallel"])
def test_two_processes_log_every_data_parallel_ranks_choices_once(tmp_path: Path, byte_corpus: Path,
                                                                    layout: str) -> None:
    """2 gloo processes, 2 micro-batches a step each, no capacity. Under DDP each rank routes its own sequences:
    the logged load is the sum of both ranks' hand counts. Under tensor parallelism (1 data-parallel rank of 2
    tensor-parallel ones) both route the same sequences: the logged load is one rank's count, not twice it. The
    counts travel in one all-reduce of layers x (experts + 1) numbers, on the logged step's last micro-batch only."""
    ranks = {"ddp": DDP_2, "tensor_parallel": TENSOR_PARALLEL}[layout]
    data_parallel = 2 if layout == "ddp" else 1
    fit(tmp_path, [*MOE_RUN, "--data.data_dir", str(byte_corpus), "--data.sequence_length", "64", *ranks,
                   *batch_sizes(4 * data_parallel, 2), *RECORD, f"--trainer.callbacks.out_dir={tmp_path}",
                   "--trainer.callbacks+=tests.helpers.AllReduceLog", f"--trainer.callbacks.out_dir={tmp_path}"])
    counts = [hand_count(step_records(tmp_path, rank, step=2, accumulation=2), capacity=None) for rank in (0, 1)]
    if layout == "ddp":
        chosen = [[a + b for a, b in zip(*layers)] for layers in zip(counts[0][0], counts[1][0])]
        assert counts[0][0] != counts[1][0]  # each rank routed sequences of its own
    else:
        chosen = counts[0][0]
        assert counts[1][0] == chosen
    assert sum(map(sum, chosen)) == DEBUG.n_layer * 2 * 2 * data_parallel * 64 * DEBUG.top_k
    assert_logged(tmp_path, chosen, [0] * DEBUG.n_layer)
    assert not any(tag.startswith("moe/dropped_share/") for tag in EventAccumulator(
        str(tmp_path / "lightning_logs" / "version_0")).Reload().Tags()["scalars"])  # no capacity: nothing per layer
    routing_size = DEBUG.n_layer * (DEBUG.n_expert + 1)
    for rank in (0, 1):
        calls = json.loads((tmp_path / f"allreduce_log_rank{rank}.json").read_text())
        assert [batch for batch, size in calls if size == routing_size] == [3]  # step 2's second micro-batch


def test_a_family_without_experts_logs_no_routing(tmp_path: Path, debug_run_args: list[str],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The GPT: no moe/ tag, no chart category, no summary line."""
    with caplog.at_level(logging.INFO):
        fit_in_process(tmp_path, debug_run_args, "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0",
                       *batch_sizes(4, 2))
    events = EventAccumulator(str(tmp_path / "lightning_logs" / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    assert "train/loss" in events.Tags()["scalars"]
    assert not any(tag.startswith("moe/") for tag in events.Tags()["scalars"])
    layout = layout_pb2.Layout.FromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    assert [category.title for category in layout.category] == ["every rank"]
    assert "run summary" in caplog.text and "expert" not in caplog.text
