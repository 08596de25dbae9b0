"""The private Lightning and torch APIs Cohort relies on, in one place, each with why; an upgrade that removes or
changes one fails here, by name, instead of somewhere in a run. pyproject.toml pins the Lightning minor version
these were checked against (2.6)."""

from __future__ import annotations

import inspect

import lightning as L
import pytest
import torch
from lightning.fabric.strategies.launchers import launcher
from lightning.fabric.utilities import load
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed import _functional_collectives, _serialization, distributed_c10d
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

# (owner, attribute, who uses it and why)
PRIVATE_METHODS = [
    (ModelCheckpoint, "_save_checkpoint", "app/safety/checkpoint_writing.py RunCheckpoint: write NAME.partial, rename"),
    (ModelCheckpoint, "_link_checkpoint", "RunCheckpoint: replace last.ckpt's link atomically, after an async write"),
    (ModelCheckpoint, "_remove_checkpoint", "RunCheckpoint: remove the oldest only once an async write is in place"),
    (ModelCheckpoint, "_save_topk_checkpoint", "RunCheckpoint.on_train_end: keep the final step in the history"),
    (ModelCheckpoint, "_save_last_checkpoint", "RunCheckpoint.on_train_end: last.ckpt at the final step"),
    (ModelCheckpoint, "_should_skip_saving_checkpoint", "RunCheckpoint.on_train_end: not twice for one step"),
    (ModelCheckpoint, "_monitor_candidates", "RunCheckpoint.on_train_end: the values a filename is made of"),
    (LightningCLI, "_parse_ckpt_path", "app/cli/lightning_cli.py: keep the user's model config, not the checkpoint's"),
    (LightningCLI, "_run_subcommand", "app/cli/lightning_cli.py: a collective timeout told with the step and checkpoint"),
    (load, "_load_distributed_checkpoint",
     "app/safety/checkpoint_reading.py load_sharded_checkpoint: shards as full tensors"),
    (torch, "_foreach_mul_", "models/parallel/parallelize.py: scale every mesh's gradients in one call when clipping"),
    (DeviceMesh, "_unflatten", "models/parallel/parallelize.py fsdp_mesh: HSDP's (replicate, shard) grid of the "
     "data-parallel ranks, on the root mesh tensor parallelism slices (slicing a _flatten-ed one is deprecated)"),
    (powerSGD_hook, "_should_compress", "app/strategies/gradient_compression.py factor_slots: each Q factor's slot"),
    (_serialization, "_streaming_load", "fault_tolerance/strategy.py: a peer's state read weights-only"),
    (ModelParallelStrategy, "_configure_launcher", "fault_tolerance/strategy.py: cohort fit starts the replica groups"),
    (distributed_c10d, "_set_pg_timeout", "tests/helpers.py StopRank: a short collective timeout once started"),
    # undocumented, though not underscored: the methods torch's schedules call on a stage, which models/parallel/pipeline.py's
    # TimedStage overrides (a rename would leave the bubble unmeasured, or a V's middle rank raising under eval())
    (PipelineStage, "forward_one_chunk", "TimedStage: a chunk's forward counts as busy, and only its forwards (not "
     "torch's metadata inference on uninitialised tensors) add a stage's auxiliary loss and routing counts"),
    (_functional_collectives, "all_to_all_single_autograd",
     "models/parallel/expert_parallel.py: the routed tokens' exchange, whose backward sends the gradients back"),
    (PipelineStage, "backward_one_chunk", "TimedStage: a chunk's backward (input gradients) counts as busy"),
    (PipelineStage, "backward_weight_one_chunk", "TimedStage: the zero-bubble weight-gradient half counts as busy"),
    (PipelineStage, "get_local_bwd_output", "TimedStage: nothing to hand the adjacent stage under eval()"),
    (PipelineStage, "set_local_bwd_input", "TimedStage: nothing to take from the adjacent stage under eval()"),
]
PRIVATE_CLASSES = [
    (launcher, "_Launcher", "fault_tolerance/job.py ReplicaGroupsLauncher: Lightning's launcher interface"),
]
PRIVATE_ATTRIBUTES = [
    ("checkpoint", "_last_checkpoint_saved", "RunCheckpoint: the newest file, for messages and the history"),
    ("checkpoint", "_last_global_step_saved", "RunCheckpoint._write replaces Trainer.save_checkpoint"),
    ("trainer", "_checkpoint_connector", "RunCheckpoint._write: dump_checkpoint without the barrier after it"),
    ("logger_connector", "should_update_logs", "models/step_logging.py: a step's values logged only when the logger writes"),
    ("model_parallel", "_save_distributed_checkpoint", "checkpoint_writing.py writes_shards: an async write's layout"),
    ("model_parallel", "_data_parallel_size", "fault_tolerance/strategy.py setup_environment: a group's mesh"),
    ("model_parallel", "_tensor_parallel_size", "fault_tolerance/strategy.py setup_environment: a group's mesh"),
    ("fsdp", "_state_dict_type", "checkpoint_writing.py writes_shards: an async write's layout"),
    ("module", "_trainer", "models/module.py configure_model: the trainer or None, without raising"),
    ("fused_adamw", "_step_supports_amp_scaling", "bad_steps, language_model: the step reads found_inf itself"),
    ("epoch_loop", "_batches_that_stepped", "fault_tolerance/strategy.py start_step: the committed step is logged; "
     "models/step_logging.py write_logged_metrics: what Lightning would log there is logged a step on"),
    ("module", "_current_fx_name", "models/step_logging.py written_a_step_behind: Lightning's per-step default outside "
     "the epoch hooks"),
]


def instances() -> dict[str, object]:
    fused_adamw = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], fused=True)
    trainer = L.Trainer(logger=False, enable_checkpointing=False)
    return {"checkpoint": ModelCheckpoint(), "trainer": trainer, "module": L.LightningModule(),
            "fused_adamw": fused_adamw, "epoch_loop": trainer.fit_loop.epoch_loop,
            "logger_connector": trainer._logger_connector,
            "model_parallel": ModelParallelStrategy(), "fsdp": FSDPStrategy()}


@pytest.mark.parametrize(("owner", "name", "why"), PRIVATE_METHODS, ids=[name for _, name, _ in PRIVATE_METHODS])
def test_private_method_exists(owner: object, name: str, why: str) -> None:
    assert callable(getattr(owner, name, None)), f"{owner}.{name} is gone ({why})"


@pytest.mark.parametrize(("owner", "name", "why"), PRIVATE_ATTRIBUTES, ids=[name for _, name, _ in PRIVATE_ATTRIBUTES])
def test_private_attribute_exists(owner: str, name: str, why: str) -> None:
    assert hasattr(instances()[owner], name), f"{owner}.{name} is gone ({why})"


@pytest.mark.parametrize(("owner", "name", "why"), PRIVATE_CLASSES, ids=[name for _, name, _ in PRIVATE_CLASSES])
def test_private_class_exists(owner: object, name: str, why: str) -> None:
    assert inspect.isclass(getattr(owner, name, None)), f"{owner}.{name} is gone ({why})"


def test_torchfts_http_transport_still_reads_through_load_from_address() -> None:
    """app/strategies/fault_tolerance/strategy.py replaces this reader (which unpickles anything) with a weights-only one."""
    http_transport = pytest.importorskip("torchft.checkpointing.http_transport")
    reader = inspect.getattr_static(http_transport.HTTPTransport, "_load_from_address")
    assert isinstance(reader, classmethod)
    assert "self._load_from_address" in inspect.getsource(http_transport.HTTPTransport.recv_checkpoint)


def test_the_checkpoint_connector_still_dumps_and_the_link_signature_holds() -> None:
    connector = instances()["trainer"]._checkpoint_connector
    assert list(inspect.signature(connector.dump_checkpoint).parameters) == ["weights_only"]
    assert list(inspect.signature(ModelCheckpoint._link_checkpoint).parameters) == ["trainer", "filepath", "linkpath"]


def test_a_fused_adamw_step_skips_itself_on_found_inf() -> None:
    """app/safety/bad_steps.py skips a bad step on the device through this attribute, as torch's grad scaler does."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param], lr=0.1, fused=True)
    param.grad = torch.ones(3)
    optimizer.found_inf = torch.tensor(1.0)
    optimizer.step()
    assert torch.equal(param.detach(), torch.ones(3)) and optimizer.state[param]["step"].item() == 0
    optimizer.found_inf = torch.tensor(0.0)
    optimizer.step()
    assert not torch.equal(param.detach(), torch.ones(3)) and optimizer.state[param]["step"].item() == 1


def test_the_fit_loop_still_counts_micro_batches_and_optimizer_steps_per_epoch() -> None:
    """app/safety/checkpoint_reading.py recount_micro_batches rewrites these counters of a checkpoint's fit loop."""
    progress = instances()["trainer"].fit_loop.state_dict()
    assert set(progress["epoch_loop.batch_progress"]["current"]) == {"ready", "started", "processed", "completed"}
    assert set(progress["epoch_loop.batch_progress"]["total"]) == {"ready", "started", "processed", "completed"}
    assert "completed" in progress["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["current"]
