"""Every shipped config parses through the CLI, documents each field, and the CPU recipes run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch.strategies import FSDPStrategy

from models.bert.network import Block as BertBlock
from models.gpt.network import Block
from tests.helpers import QUICKSTART, QUIET, REPO_ROOT, one_line_error, run_cohort, run_in_process

CONFIGS = sorted((REPO_ROOT / "configs").rglob("*.yaml"))
TRAINER_PRESETS = sorted((REPO_ROOT / "configs" / "trainer").glob("*.yaml"))
RECIPES = [path for path in CONFIGS if path not in TRAINER_PRESETS]


def test_configs_exist() -> None:
    names = {path.stem for path in TRAINER_PRESETS}
    assert {"cpu", "ddp_cpu", "gpu_bf16", "ddp_gpu_bf16", "multinode_gpu_bf16", "fsdp_gpu_bf16", "model_parallel_cpu",
            "model_parallel_gpu_bf16", "hsdp_cpu", "hsdp_gpu_bf16"} <= names
    assert REPO_ROOT / "configs" / "quickstart.yaml" in RECIPES


# recipe and preset pairs that fit refuses, and so must --print_config: the first line of the refusal
REFUSED = {
    ("quickstart.yaml", "model_parallel_gpu_bf16"): "data.global_batch_size=32 is not a multiple of data.micro_batch_size=16 x 8",
    ("quickstart.yaml", "multinode_gpu_bf16"): "data.global_batch_size=32 is not a multiple of data.micro_batch_size=16 x 16",
    ("quickstart.yaml", "pipeline_gpu_bf16"): "data.global_batch_size=32 is not a multiple of data.micro_batch_size=16 x 4",
    ("gpt-6.7b/pretrain.yaml", "fsdp_gpu_bf16"): "model.activation_checkpointing is for DDP and model_parallel",
    ("llama-8b/continued_pretraining.yaml", "fsdp_gpu_bf16"): "model.activation_checkpointing is for DDP and model_parallel",
    ("llama-8b/continued_pretraining.yaml", "pipeline_cpu"): "pipeline_microbatches=4 does not divide data.micro_batch_size=1",
    ("llama-8b/continued_pretraining.yaml", "pipeline_gpu_bf16"): "pipeline_microbatches=4 does not divide data.micro_batch_size=1",
    ("bert-large/pretrain.yaml", "multinode_gpu_bf16"): "data.global_batch_size=64 is not a multiple of data.micro_batch_size=8 x 16",
    ("llama-small/pretrain.yaml", "model_parallel_gpu_bf16"): "data.global_batch_size=32 is not a multiple of data.micro_batch_size=16 x 8",
    ("llama-small/pretrain.yaml", "multinode_gpu_bf16"): "data.global_batch_size=32 is not a multiple of data.micro_batch_size=16 x 16",
    ("llama-small/pretrain.yaml", "pipeline_gpu_bf16"): "data.global_batch_size=32 is not a multiple of data.micro_batch_size=16 x 4",
    ("bert-small/pretrain.yaml", "model_parallel_gpu_bf16"): "data.global_batch_size=32 is not a multiple of data.micro_batch_size=16 x 8",
    ("bert-small/pretrain.yaml", "multinode_gpu_bf16"): "data.global_batch_size=32 is not a multiple of data.micro_batch_size=16 x 16",
    ("bert-small/pretrain.yaml", "pipeline_gpu_bf16"): "data.global_batch_size=32 is not a multiple of data.micro_batch_size=16 x 4",
    ("resnet-small/digits.yaml", "model_parallel_gpu_bf16"): "data.global_batch_size=64 is not a multiple of data.micro_batch_size=32 x 8",
    ("resnet-small/digits.yaml", "multinode_gpu_bf16"): "data.global_batch_size=64 is not a multiple of data.micro_batch_size=32 x 16",
    ("resnet-small/digits.yaml", "pipeline_cpu"): "ImageClassifier has no pipeline split",
    ("resnet-small/digits.yaml", "pipeline_gpu_bf16"): "data.global_batch_size=64 is not a multiple of data.micro_batch_size=32 x 4",
    **{(recipe, preset): "data.num_workers=4: a fault-tolerant group reads each step's samples once the step's quorum"
       for recipe in ("gpt2/pretrain.yaml", "gpt-6.7b/pretrain.yaml", "bert-large/pretrain.yaml",
                      "llama-8b/continued_pretraining.yaml")
       for preset in ("fault_tolerant_cpu", "fault_tolerant_gpu_bf16", "fault_tolerant_groups_cpu")},
    # 2 groups x 2 processes read 4 micro-batches per step: a recipe's micro batch must be a quarter of its global one
    **{(recipe, "fault_tolerant_groups_cpu"): "data.global_batch_size=32 is not a multiple of data.micro_batch_size=16 "
       "x 2 replica groups of 2 processes" for recipe in ("quickstart.yaml", "llama-small/pretrain.yaml",
                                                          "bert-small/pretrain.yaml")},
    ("resnet-small/digits.yaml", "fault_tolerant_groups_cpu"): "data.global_batch_size=64 is not a multiple of "
                                                               "data.micro_batch_size=32 x 2 replica groups of 2",
}

# the 4 CPU processes of hsdp_cpu: the recipes' global batches are sized for 1 or 2
REFUSED.update({
    ("quickstart.yaml", "hsdp_cpu"): "data.global_batch_size=32 is not a multiple of data.micro_batch_size=16 x 4",
    ("bert-small/pretrain.yaml", "hsdp_cpu"): "data.global_batch_size=32 is not a multiple of data.micro_batch_size=16 x 4",
    ("llama-small/pretrain.yaml", "hsdp_cpu"): "data.global_batch_size=32 is not a multiple of data.micro_batch_size=16 x 4",
    ("resnet-small/digits.yaml", "hsdp_cpu"): "data.global_batch_size=64 is not a multiple of data.micro_batch_size=32 x 4",
})
# the mixture of experts' recipe has the small Llama's batch
REFUSED.update({("moe-small/pretrain.yaml", preset): refusal for (recipe, preset), refusal in list(REFUSED.items())
                if recipe == "llama-small/pretrain.yaml"})
# hsdp_gpu_bf16 has multinode_gpu_bf16's 16 data-parallel ranks (2 nodes of 8 GPUs), so the same refusals
REFUSED.update({(recipe, "hsdp_gpu_bf16"): refusal for (recipe, preset), refusal in list(REFUSED.items())
                if preset == "multinode_gpu_bf16"})
# expert parallelism needs a family with experts; on the GPU preset's 8 data-parallel ranks a recipe's batch sizes are
# refused first, as model_parallel_gpu_bf16's 8 refuse them
NO_EXPERTS = "has no experts to split over expert_parallel_size"
REFUSED.update({(str(recipe.relative_to(REPO_ROOT / "configs")), preset): NO_EXPERTS for recipe in RECIPES
                if recipe.parent.name != "moe-small" for preset in ("expert_parallel_cpu", "expert_parallel_gpu_bf16")})
REFUSED.update({(recipe, "expert_parallel_gpu_bf16"): refusal for (recipe, preset), refusal in list(REFUSED.items())
                if preset == "model_parallel_gpu_bf16"})

# recipes that start from a Hugging Face folder the user brings (model.init_from), which this machine has not got
STARTS_FROM_A_FOLDER = {"llama-8b/continued_pretraining.yaml"}

if not torch.cuda.is_available():  # "devices: -1" is then one process: no room for a server and a worker
    REFUSED.update({(str(recipe.relative_to(REPO_ROOT / "configs")), "async_ps_gpu_bf16"):
                    "needs a server and at least one worker" for recipe in RECIPES})


@pytest.mark.parametrize("preset", TRAINER_PRESETS, ids=lambda p: p.stem)
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.parent.name + "/" + p.stem)
def test_recipe_and_preset_parse_and_pass_the_config_checks(recipe: Path, preset: Path,
                                                            capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """--print_config runs the checks fit runs on the config alone (sizes, batch arithmetic, the model's fit)."""
    args = ["fit", "-c", str(recipe), "-c", str(preset), "--print_config"]
    name = str(recipe.relative_to(REPO_ROOT / "configs"))
    if name in STARTS_FROM_A_FOLDER:  # everything else the recipe sets; its folder's absence: the test below
        args.insert(-1, "--model.init_from=null")
    refusal = REFUSED.get((name, preset.stem))
    if refusal is not None:
        assert refusal in one_line_error(args, monkeypatch)
        return
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(args, monkeypatch)
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path: models." in printed and "model_name:" in printed and "global_batch_size:" in printed


def test_a_recipe_whose_pretrained_folder_is_not_there_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = REPO_ROOT / "configs/llama-8b/continued_pretraining.yaml"
    args = ["fit", "-c", str(REPO_ROOT / "configs/trainer/model_parallel_gpu_bf16.yaml"), "-c", str(recipe),
            "--print_config"]
    assert ("model.init_from=models/Llama-3.1-8B is not a Hugging Face model folder (no config.json there)"
            in one_line_error(args, monkeypatch))


def test_print_config_accepts_what_fit_accepts_on_this_cpu(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """16-mixed runs as bf16-mixed on a CPU, which the pipeline takes; only fp16 proper is refused with stages."""
    args = ["fit", "-c", str(REPO_ROOT / "configs/quickstart.yaml"), "-c", str(REPO_ROOT / "configs/trainer/pipeline_cpu.yaml"),
            "--trainer.precision", "16-mixed", "--print_config"]
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(args, monkeypatch)
    assert exit_info.value.code in (0, None)
    assert "PipelineParallelStrategy" in capsys.readouterr().out


def test_fsdp_preset_wraps_and_checkpoints_each_transformer_block() -> None:
    """The strategy the fsdp preset builds (constructing it needs no GPU): one FSDP unit per block, GPT's or BERT's."""
    strategy_config = yaml.safe_load((REPO_ROOT / "configs/trainer/fsdp_gpu_bf16.yaml").read_text())["trainer"]["strategy"]
    strategy_config["init_args"]["activation_checkpointing_policy"] = ["models.gpt.network.Block"]
    parser = ArgumentParser()
    parser.add_argument("--strategy", type=FSDPStrategy)
    strategy = parser.instantiate(parser.parse_object({"strategy": strategy_config})).strategy
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {Block, BertBlock}
    assert strategy._activation_checkpointing_kwargs["auto_wrap_policy"]._module_classes == {Block}
    assert strategy.sharding_strategy.name == "FULL_SHARD" and strategy._state_dict_type == "sharded"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.parent.name + "/" + p.stem)
def test_every_field_carries_a_comment(path: Path) -> None:
    lines = path.read_text().splitlines()
    fields = [line for line in lines if re.match(r"^\s*[A-Za-z_][\w.]*:\s*[^\s#]", line)]
    assert fields, f"{path} sets no fields"
    undocumented = [line for line in fields if "#" not in line]
    assert not undocumented, f"fields without a comment in {path}: {undocumented}"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.parent.name + "/" + p.stem)
def test_recipes_validate_the_same_samples_at_any_world_size(recipe: Path) -> None:
    """A recipe limits validation with data.val_samples, a count of samples; an int trainer.limit_val_batches counts
    micro-batches per rank, so the samples, and val/loss, would change with the world size."""
    assert "limit_val_batches" not in yaml.safe_load(recipe.read_text()).get("trainer", {})


@pytest.mark.slow
def test_quickstart_runs_on_two_processes(tmp_path: Path, byte_corpus: Path) -> None:
    """The README's scaling line: the quickstart recipe with the ddp_cpu preset composed after it."""
    result = run_cohort(["fit", *QUICKSTART, "-c", str(REPO_ROOT / "configs/trainer/ddp_cpu.yaml"), *QUIET,
                         "--data.data_dir", str(byte_corpus), "--trainer.max_steps", "2",
                         "--data.val_samples", "32", "--val_every_n_steps", "2",
                         "--model.max_new_tokens", "5"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "global batch 32 = micro batch 16 x 2 data-parallel ranks x 1 accumulation steps" in result.stdout + result.stderr
    assert "--- sample after 2 steps ---" in result.stdout
