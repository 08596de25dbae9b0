"""``cohort export`` writes a checkpoint as a Hugging Face GPT-2 folder whose logits are Cohort's: computed by a
GPT-2 forward written here from Hugging Face's names and layout (needs no transformers, so it runs everywhere), and
by ``transformers.GPT2LMHeadModel.from_pretrained`` where transformers is installed; a mixture of experts as a Mixtral
or Qwen3-MoE folder, as its shape says. Mistakes get one line. (tests/test_pretrained.py exports every family after
training from transformers' own folders.)"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from app.__main__ import main
from app.safety.checkpoint_reading import consolidate
from core.errors import UserError
from models.class_paths import class_path_of
from models.gpt.family import GPTLanguageModel
from models.gpt.huggingface import huggingface_gpt2_state_dict
from models.gpt.network import GPTConfig
from models.module import CohortModule
from models.moe.family import MoELanguageModel
from models.moe.huggingface import huggingface_moe_config
from models.moe.network import MOE_CONFIGS
from tests.helpers import MODEL_PARALLEL, fit, last_checkpoint, one_line_error

TOKENS = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))  # a full debug-model context
GPT2_NAMES = {f"transformer.{name}" for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")} | {
    f"transformer.h.{i}.{module}.{kind}" for i in range(2) for kind in ("weight", "bias")
    for module in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}  # the debug model's


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return random_checkpoint(GPTLanguageModel("debug", vocab_size=256), tmp_path / "last.ckpt")


def random_checkpoint(module: CohortModule, path: Path) -> Path:
    """A checkpoint of ``module`` with the keys of cohort fit's that export and load_from_checkpoint read, every
    weight random: a bias or norm put in the wrong place, at its initial 0 or 1, would change no logits."""
    module.configure_model()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    torch.save({"pytorch-lightning_version": L.__version__, "global_step": 3, "state_dict": module.state_dict(),
                "hyper_parameters": dict(module.hparams), "cohort_model_class": class_path_of(type(module))}, path)
    return path


def cohort_logits(path: Path, family: type[CohortModule] = GPTLanguageModel) -> torch.Tensor:
    with torch.no_grad():
        return family.load_from_checkpoint(path).eval()(TOKENS)


def gpt2_logits(folder: Path) -> torch.Tensor:
    """GPT-2's forward as transformers' modeling_gpt2.py computes it, from the folder's config.json and
    model.safetensors: a Conv1D is ``x @ weight + bias``, c_attn's output is [q | k | v], the head is wte."""
    config, weights = json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")
    w = {name.removeprefix("transformer."): tensor for name, tensor in weights.items()}
    C, n_head, (B, T) = config["n_embd"], config["n_head"], TOKENS.shape
    assert config["activation_function"] == "gelu_new" and config["tie_word_embeddings"]  # what this forward does

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (C,), w[f"{name}.weight"], w[f"{name}.bias"], config["layer_norm_epsilon"])

    def conv1d(x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ w[f"{name}.weight"] + w[f"{name}.bias"]

    x = w["wte.weight"][TOKENS] + w["wpe.weight"][:T]
    for i in range(config["n_layer"]):
        q, k, v = conv1d(norm(x, f"h.{i}.ln_1"), f"h.{i}.attn.c_attn").split(C, dim=-1)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + conv1d(y, f"h.{i}.attn.c_proj")
        hidden = F.gelu(conv1d(norm(x, f"h.{i}.ln_2"), f"h.{i}.mlp.c_fc"), approximate="tanh")
        x = x + conv1d(hidden, f"h.{i}.mlp.c_proj")
    return norm(x, "ln_f") @ w["wte.weight"].T


def export(checkpoint: Path, out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["cohort"])
    main(["export", str(checkpoint), "--out", str(out)])


def test_export_writes_gpt2_weights_that_compute_cohorts_logits(checkpoint: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hf"
    out.mkdir()  # an empty folder is taken, as if new
    export(checkpoint, out, monkeypatch)
    printed = capsys.readouterr().out
    assert f"wrote {out}: GPT2LMHeadModel with 2 layers x 2 heads, width 32, vocabulary 256, at step 3" in printed
    assert "no tokenizer was written: this model reads UTF-8 bytes" in printed
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf", "last.ckpt"]  # no partial left beside it
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "model.safetensors"]
    assert load_file(out / "model.safetensors").keys() == GPT2_NAMES  # no lm_head: tied to wte, as GPT-2 stores it
    torch.testing.assert_close(gpt2_logits(out), cohort_logits(checkpoint), rtol=0, atol=1e-5)


def test_transformers_loads_the_export_with_cohorts_logits(checkpoint: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[hf]'")
    export(checkpoint, tmp_path / "hf", monkeypatch)
    model, loading = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # tied, as Cohort's
    with torch.no_grad():
        logits = model.eval()(TOKENS).logits
    # seen: at most 8e-7, with transformers 4.40 and 5.25 on CPU
    torch.testing.assert_close(logits, cohort_logits(checkpoint), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_export_reads_a_sharded_checkpoint_folder(debug_run_args: list[str], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A real run's checkpoint: one step of FSDP2 in one process, which writes a folder of shards."""
    run = fit(tmp_path / "run", [*debug_run_args, "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0"],
              *MODEL_PARALLEL, "--trainer.devices", "1", "--trainer.strategy.init_args.data_parallel_size", "1")
    folder = last_checkpoint(run)
    assert folder.is_dir()
    export(folder, tmp_path / "hf", monkeypatch)
    consolidate(folder, tmp_path / "consolidated.ckpt")  # the file load_from_checkpoint reads
    torch.testing.assert_close(gpt2_logits(tmp_path / "hf"), cohort_logits(tmp_path / "consolidated.ckpt"), rtol=0,
                               atol=1e-5)


def test_export_refuses_a_folder_that_is_not_empty_in_one_line(checkpoint: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    message = one_line_error(["export", str(checkpoint), "--out", str(tmp_path / "hf")], monkeypatch)
    assert f"--out {tmp_path / 'hf'} already exists and is not an empty folder" in message
    assert [path.name for path in (tmp_path / "hf").iterdir()] == ["notes.txt"]


def test_export_names_a_missing_checkpoint_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    message = one_line_error(["export", str(tmp_path / "nope.ckpt"), "--out", str(tmp_path / "hf")], monkeypatch)
    assert f"checkpoint {tmp_path / 'nope.ckpt'} does not exist" in message
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("change, expected", [
    ({"hyper_parameters": {}},
     "is not a checkpoint of a Cohort GPT, Llama, MoE or BERT (no model_name among its hyperparameters)"),
    ({"hyper_parameters": {"model_name": "small", "vocab_size": 256}},
     "the weights are not those of a Cohort GPT of 4 layers, width 128, vocabulary 256 (missing ['blocks.2.attn"),
    ({"cohort_model_class": "models.resnet.family.ImageClassifier"},
     "holds a model of the family ImageClassifier, and cohort export writes GPT, Llama, MoE and BERT folders only"),
], ids=["no-model-name", "another-size", "another-family"])
def test_export_refuses_what_is_not_a_cohort_gpt_checkpoint_in_one_line(
    change: dict[str, Any], expected: str, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.save({**torch.load(checkpoint, weights_only=True), **change}, checkpoint)
    message = one_line_error(["export", str(checkpoint), "--out", str(tmp_path / "hf")], monkeypatch)
    assert expected in message
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_model_without_biases_is_not_gpt2() -> None:
    config = GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=4, vocab_size=16, bias=False)
    with pytest.raises(UserError, match=r"no biases \(bias=False\), and GPT-2 has biases"):
        huggingface_gpt2_state_dict({}, config)


MOE_ARCHITECTURES = {"debug": "MixtralForCausalLM", "debug-qwen3": "Qwen3MoeForCausalLM"}  # the format of each shape


@pytest.mark.parametrize("size", MOE_ARCHITECTURES)
def test_export_writes_a_mixture_of_experts_in_the_format_of_its_shape(
        size: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Without qk_norm a Mixtral folder, with it a Qwen3-MoE one, holding one tensor per expert: imported again, it
    computes the checkpoint's logits exactly."""
    checkpoint = random_checkpoint(MoELanguageModel(size), tmp_path / "last.ckpt")
    export(checkpoint, tmp_path / "hf", monkeypatch)
    architecture = MOE_ARCHITECTURES[size]
    assert f"wrote {tmp_path / 'hf'}: {architecture} with 2 layers x 4 heads, width 32, vocabulary 256, at step 3" \
        in capsys.readouterr().out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [architecture]
    with torch.no_grad():
        logits = MoELanguageModel(size, init_from=str(tmp_path / "hf")).build().eval()(TOKENS)
    assert torch.equal(logits, cohort_logits(checkpoint, MoELanguageModel))


@pytest.mark.parametrize("size", MOE_ARCHITECTURES)
def test_transformers_loads_a_mixture_of_experts_export_with_cohorts_logits(
        size: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[hf]'")
    checkpoint = random_checkpoint(MoELanguageModel(size), tmp_path / "last.ckpt")
    export(checkpoint, tmp_path / "hf", monkeypatch)
    loader = getattr(transformers, MOE_ARCHITECTURES[size])
    model, loading = loader.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
    with torch.no_grad():
        logits = model.eval()(TOKENS).logits
    # float32 rounding, the experts' outputs summed in another order: logits about 2 in size, each off by about 1e-7
    torch.testing.assert_close(logits, cohort_logits(checkpoint, MoELanguageModel), rtol=0, atol=1e-5)


@pytest.mark.parametrize("change, expected", [
    ({"shared_expert_size": 16}, "this MoE has a shared expert (shared_expert_size=16), which MixtralForCausalLM does "
     "not compute"),
    ({"normalize_top_k": False}, "this MoE has the chosen experts' probabilities left unnormalised (normalize_top_k "
     "false), which MixtralForCausalLM does not compute"),
    ({"qk_norm": True, "shared_expert_size": 16}, "which Qwen3MoeForCausalLM does not compute"),
], ids=["shared-expert", "mixtral-unnormalised", "qwen3-shared-expert"])
def test_a_mixture_of_experts_neither_format_computes_is_refused_in_one_line(change: dict[str, Any],
                                                                             expected: str) -> None:
    with pytest.raises(UserError) as error:
        huggingface_moe_config(replace(MOE_CONFIGS["debug"], **change))
    assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)
