"""Starting from pretrained weights (models/interchange.py, and each family's models/<family>/huggingface.py): a
Hugging Face folder's tensors load into Cohort's networks exactly, into every rank's slice under FSDP2, tensor
parallelism and the pipeline; a folder that is not the named size's, or not safetensors, is refused in one line
before anything is built. Folders that
LlamaForCausalLM, GPT2LMHeadModel, BertForMaskedLM, MixtralForCausalLM and Qwen3MoeForCausalLM saved give Cohort the
logits transformers computes, and each family imported, trained and exported writes what transformers saved, holding
the trained weights: against the folders and logits saved in tests/data/huggingface/ without transformers, and against
transformers itself where it is installed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from app.__main__ import main
from core.errors import UserError
from models.bert.family import BertMaskedLanguageModel
from models.bert.huggingface import BERT_HUGGING_FACE, bert_source
from models.bert.network import BERT, BERT_CONFIGS
from models.gpt.family import GPTLanguageModel
from models.interchange import HuggingFaceFolder, check_config_is
from models.llama.family import LlamaLanguageModel
from models.llama.huggingface import LLAMA_HUGGING_FACE
from models.llama.network import LLAMA_CONFIGS, Llama
from models.moe.family import MoELanguageModel
from models.moe.huggingface import MOE_HUGGING_FACE
from models.moe.network import MOE_CONFIGS
from tests.helpers import (
    COMPARABLE_RUN, CONFIG_DIR, DDP_2, MODEL_PARALLEL, assert_comparable_runs_agree, batch_sizes, fit, fit_in_process,
    last_checkpoint, last_checkpoint_contents, one_line_error, scalars,
)
from tests.huggingface_references import reference_models, reference_tokens, saved_reference

DEBUG = LLAMA_CONFIGS["debug"]
# config.json of a LlamaForCausalLM of the debug size, as save_pretrained writes it (transformers 4 and 5 alike)
DEBUG_CONFIG_JSON = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": DEBUG.vocab_size,
    "hidden_size": DEBUG.n_embd, "intermediate_size": DEBUG.intermediate_size, "num_hidden_layers": DEBUG.n_layer,
    "num_attention_heads": DEBUG.n_head, "num_key_value_heads": DEBUG.n_kv_head, "hidden_act": "silu",
    "max_position_embeddings": DEBUG.block_size, "rms_norm_eps": DEBUG.norm_eps, "tie_word_embeddings": False,
    "rope_theta": DEBUG.rope_base, "attention_bias": False, "mlp_bias": False,
}


def write_llama_folder(folder: Path, seed: int = 5, **config_changes: object) -> Llama:
    """A Hugging Face Llama folder of the debug size holding a Cohort Llama's weights drawn under ``seed``."""
    torch.manual_seed(seed)
    network = Llama(DEBUG)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**DEBUG_CONFIG_JSON, **config_changes}))
    save_file(huggingface_names(network.state_dict()), folder / "model.safetensors")
    return network


def huggingface_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Cohort Llama's tensors under LlamaForCausalLM's names: ``model.`` before all but the head."""
    return {name if name == "lm_head.weight" else f"model.{name}": tensor.contiguous()
            for name, tensor in state_dict.items()}


def test_a_folder_loads_into_the_network_exactly(tmp_path: Path) -> None:
    """The family builds its network from the folder (models/parallel/parallelize.py on the meta device, then each parameter
    read by name) and computes what the network that wrote it computes, to the bit."""
    source = write_llama_folder(tmp_path / "llama")
    family = LlamaLanguageModel("debug", init_from=str(tmp_path / "llama"))
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(family.build()(tokens), source(tokens))


def reshard(folder: Path, in_second_shard: Callable[[str], bool]) -> None:
    """The folder's model.safetensors split into two shards and their index, as save_pretrained writes a large
    model: the tensors ``in_second_shard`` names go to the second."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": {n: t for n, t in tensors.items() if not in_second_shard(n)},
              "model-00002-of-00002.safetensors": {n: t for n, t in tensors.items() if in_second_shard(n)}}
    for file, shard in shards.items():
        save_file(shard, folder / file)
    weight_map = {name: file for file, shard in shards.items() for name in shard}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_sharded_safetensors_with_an_index_load_too(tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    source = write_llama_folder(folder)
    names = sorted(huggingface_names(source.state_dict()))
    reshard(folder, lambda name: name in names[len(names) // 2:])
    tokens = torch.randint(0, DEBUG.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(LlamaLanguageModel("debug", init_from=str(folder)).build()(tokens), source(tokens))


def test_experts_stored_in_two_shards_load_too(tmp_path: Path) -> None:
    """Each stacked expert parameter is read from its experts' tensors in both shards, into its own expert's place:
    the network computes what the one-file folder's does, to the bit."""
    saved, tokens, _ = saved_reference("mixtral")
    shutil.copytree(saved, tmp_path / "mixtral")
    reshard(tmp_path / "mixtral", lambda name: ".experts.1." in name or ".experts.3." in name)
    with torch.no_grad():
        assert torch.equal(FAMILIES["mixtral"](tmp_path / "mixtral").build()(tokens),
                           FAMILIES["mixtral"](saved).build()(tokens))


def test_a_bert_pretraining_checkpoint_loads_without_its_pooler_and_next_sentence_head(tmp_path: Path) -> None:
    """A BERT checkpoint as Google's release converted it: LayerNorm weights named gamma and beta, the decoder's
    bias as cls.predictions.bias, the tied decoder weight stored once, and the pooler and next-sentence head beside
    (which Cohort's masked-LM BERT leaves unread): it loads, and computes what the network that wrote it computes."""
    config = BERT_CONFIGS["bert-tiny"]
    torch.manual_seed(3)
    source = BERT(config).eval()
    tensors = {bert_source(name, {})[0]: tensor.contiguous() for name, tensor in source.named_parameters()}
    tensors = {name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): tensor
               for name, tensor in tensors.items()}
    tensors |= {"bert.pooler.dense.weight": torch.zeros(32, 32), "cls.seq_relationship.weight": torch.zeros(2, 32)}
    (tmp_path / "bert").mkdir()
    save_file(tensors, tmp_path / "bert" / "model.safetensors")
    (tmp_path / "bert" / "config.json").write_text(json.dumps({
        "model_type": "bert", "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
        "hidden_size": config.n_embd, "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings, "vocab_size": config.vocab_size}))
    family = BertMaskedLanguageModel("bert-tiny", vocab_size=256, init_from=str(tmp_path / "bert"))
    BERT_HUGGING_FACE.check_pretrained(HuggingFaceFolder(tmp_path / "bert"), family.config, "bert-tiny")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(family.build().eval()(tokens), source(tokens))


@pytest.mark.parametrize("change, expected", [
    (lambda folder: (folder / "config.json").unlink(), "is not a Hugging Face model folder (no config.json there)"),
    (lambda folder: (folder / "model.safetensors").rename(folder / "pytorch_model.bin"),
     "holds pickled .bin weights, which Cohort does not unpickle: convert them once"),
    (lambda folder: (folder / "config.json").write_text(json.dumps({**DEBUG_CONFIG_JSON, "model_type": "mistral"})),
     "holds a 'mistral' model, not a Llama"),
    (lambda folder: (folder / "config.json").write_text(json.dumps({**DEBUG_CONFIG_JSON, "hidden_size": 64})),
     "is not a model 'debug': its config.json has n_embd 64 (model 'debug': 32)"),
    (lambda folder: (folder / "config.json").write_text(json.dumps(
        {**DEBUG_CONFIG_JSON, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})),
     "asks for what Cohort's Llama does not compute: rope type='yarn' (Cohort's Llama: 'default or llama3')"),
    (lambda folder: save_file({"model.embed_tokens.weight": torch.zeros(256, 32)}, folder / "model.safetensors"),
     "does not hold the weights its config.json describes (missing: lm_head.weight, model.layers.0."),
    (lambda folder: save_file({**huggingface_names(Llama(DEBUG).state_dict()), "model.extra.weight": torch.zeros(1)},
                              folder / "model.safetensors"),
     "(not used: model.extra.weight)"),
], ids=["no-config", "pickle", "another-architecture", "another-size", "rope-scaling", "missing", "extra"])
def test_a_folder_that_is_not_the_named_size_is_refused_in_one_line(tmp_path: Path, change: object,
                                                                     expected: str) -> None:
    folder = tmp_path / "llama"
    write_llama_folder(folder)
    change(folder)
    with pytest.raises(UserError) as error:
        LLAMA_HUGGING_FACE.check_pretrained(HuggingFaceFolder(folder), DEBUG, "debug")
    assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)


def moe_folder(tmp_path: Path, family: str, **config_changes: object) -> Path:
    """A copy of the saved Mixtral or Qwen3-MoE folder with ``config_changes`` in its config.json."""
    folder = tmp_path / family
    shutil.copytree(saved_reference(family)[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


def change_tensors(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")


MIXTRAL_EXPERT = "model.layers.1.block_sparse_moe.experts.3"


@pytest.mark.parametrize("family, size, config_changes, tensor_change, expected", [
    ("mixtral", "debug", {"num_local_experts": 8}, None,
     "is not a model 'debug': its config.json has n_expert 8 (model 'debug': 4)"),
    ("qwen3_moe", "debug-qwen3", {"moe_intermediate_size": 32}, None,
     "is not a model 'debug-qwen3': its config.json has expert_size 32 (model 'debug-qwen3': 16)"),
    ("qwen3_moe", "debug", {}, None, "is not a model 'debug': its config.json has expert_size 16 (model 'debug': 32), "
     "normalize_top_k False (model 'debug': True), head_dim 16 (model 'debug': None), qk_norm True (model 'debug': "
     "False)"),
    ("mixtral", "debug-qwen3", {}, None, "head_dim None (model 'debug-qwen3': 16), qk_norm False (model 'debug-qwen3': "
     "True)"),
    ("qwen3_moe", "debug-qwen3", {"model_type": "qwen2_moe"}, None,
     "holds a 'qwen2_moe' model, not a Mixtral or Qwen3-MoE: give a folder of one of them"),
    ("mixtral", "debug", {"sliding_window": 4096}, None,
     "its config.json asks for what Cohort's Mixtral does not compute: sliding_window=4096 (Cohort's Mixtral: None)"),
    ("qwen3_moe", "debug-qwen3", {"use_sliding_window": True, "sliding_window": 32}, None,
     "asks for what Cohort's Qwen3-MoE does not compute: sliding_window=32 (Cohort's Qwen3-MoE: None)"),
    ("qwen3_moe", "debug-qwen3", {"decoder_sparse_step": 2}, None,
     "asks for what Cohort's Qwen3-MoE does not compute: decoder_sparse_step=2 (Cohort's Qwen3-MoE: 1)"),
    ("qwen3_moe", "debug-qwen3", {"mlp_only_layers": [1]}, None,
     "asks for what Cohort's Qwen3-MoE does not compute: mlp_only_layers=[1] (Cohort's Qwen3-MoE: [])"),
    ("mixtral", "debug", {}, lambda tensors: tensors.pop(f"{MIXTRAL_EXPERT}.w2.weight"),
     f"does not hold the weights its config.json describes (missing: {MIXTRAL_EXPERT}.w2.weight)"),
    ("mixtral", "debug", {}, lambda tensors: tensors.update({f"{MIXTRAL_EXPERT}.w1.weight": torch.zeros(16, 32)}),
     f"(other shapes: {MIXTRAL_EXPERT}.w1.weight (16, 32) (Cohort's layers.1.mlp.experts.gate_proj: (4, 32, 32)))"),
    ("mixtral", "debug", {}, lambda tensors: tensors.update({f"{MIXTRAL_EXPERT[:-1]}4.w1.weight": torch.zeros(1)}),
     f"(not used: {MIXTRAL_EXPERT[:-1]}4.w1.weight)"),
], ids=["more-experts", "wider-experts", "qwen3-folder-for-a-mixtral-size", "mixtral-folder-for-a-qwen3-size",
        "another-architecture", "sliding-window", "qwen3-sliding-window", "dense-layers-by-step",
        "dense-layers-listed", "missing-expert", "expert-of-another-shape", "an-expert-too-many"])
def test_an_moe_folder_that_is_not_the_named_size_is_refused_in_one_line(
        tmp_path: Path, family: str, size: str, config_changes: dict[str, object],
        tensor_change: Callable[[dict[str, torch.Tensor]], None] | None, expected: str) -> None:
    """A Mixtral or Qwen3-MoE folder is read as its model_type says, then must be the named size (one of the other
    shape is refused naming what differs), compute only what Cohort's MoE computes (no sliding window, every layer
    routed) and hold each expert's tensors in their shapes, with none beside them."""
    folder = moe_folder(tmp_path, family, **config_changes)
    if tensor_change is not None:
        change_tensors(folder, tensor_change)
    with pytest.raises(UserError) as error:
        MOE_HUGGING_FACE.check_pretrained(HuggingFaceFolder(folder), MOE_CONFIGS[size], size)
    assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)


# config.json of the Hub's Mixtral-8x7B-v0.1 (transformers 4.36) and Qwen3-30B-A3B (4.51), as published
HUB_CONFIGS = {
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 32000},
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936},
}


@pytest.mark.parametrize("size", HUB_CONFIGS)
def test_the_hubs_config_json_describes_the_named_size(tmp_path: Path, size: str) -> None:
    """The published models' config.json (the Hub's Qwen3-MoE writes num_experts, which transformers 5 saves as
    num_local_experts: both are read) is exactly the size of the same name, so their folders load into it."""
    (tmp_path / "config.json").write_text(json.dumps(HUB_CONFIGS[size]))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))  # the config alone
    folder = HuggingFaceFolder(tmp_path)
    check_config_is(MOE_CONFIGS[size], MOE_HUGGING_FACE.config_from(folder), size, folder)


def test_the_command_refuses_a_folder_of_another_size_before_it_starts(tmp_path: Path, byte_corpus: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    write_llama_folder(tmp_path / "llama")
    args = ["fit", "-c", str(CONFIG_DIR / "llama-small/pretrain.yaml"), "--data.data_dir", str(byte_corpus),
            "--model.init_from", str(tmp_path / "llama")]
    refusal = one_line_error(args, monkeypatch)
    assert "is not a model 'small': its config.json has n_layer 2 (model 'small': 4)" in refusal
    moe = ["fit", "-c", str(CONFIG_DIR / "moe-small/pretrain.yaml"), "--data.data_dir", str(byte_corpus),
           "--model.init_from", str(saved_reference("mixtral")[0])]
    refusal = one_line_error(moe, monkeypatch)
    assert "is not a model 'small': its config.json has n_layer 2 (model 'small': 4)" in refusal


IMPORTED_LAYOUTS = {
    "ddp": DDP_2,
    "fsdp2": MODEL_PARALLEL,
    "tensor-parallel": [*MODEL_PARALLEL, "--trainer.strategy.init_args.data_parallel_size", "1",
                        "--trainer.strategy.init_args.tensor_parallel_size", "2"],
    "pipeline": ["-c", str(CONFIG_DIR / "trainer/pipeline_cpu.yaml")],
    "fsdp2-checkpointed": [*MODEL_PARALLEL, "--model.activation_checkpointing", "true"],
    "local-sgd-every-step": [*DDP_2, "--local_updates.method", "local_sgd", "--local_updates.sync_every", "1"],
    "asynchronous-one-worker": ["-c", str(CONFIG_DIR / "trainer/async_ps_cpu.yaml"), "--trainer.devices", "2",
                                "--trainer.strategy.init_args.max_staleness", "0",
                                "--trainer.strategy.init_args.staleness_policy", "drop"],
}


@pytest.fixture(scope="module")
def imported_runs(tmp_path_factory: pytest.TempPathFactory, byte_corpus: Path) -> dict[str, Path]:
    """COMPARABLE_RUN's 4 clipped steps of the debug Llama from the same imported folder on one process and under
    each of IMPORTED_LAYOUTS, and from the seed's weights on one process."""
    folder = tmp_path_factory.mktemp("imported") / "llama"
    write_llama_folder(folder)
    run = ["-c", str(CONFIG_DIR / "llama-small/pretrain.yaml"), "--model.model_name", "debug",
           "--data.data_dir", str(byte_corpus), "--data.sequence_length", "64", "--trainer.log_every_n_steps", "1",
           "--model.optimizer.warmup_steps", "2", "--model.max_new_tokens", "0", *COMPARABLE_RUN]
    runs = {"one process": [], **IMPORTED_LAYOUTS}
    imported = [*run, "--model.init_from", str(folder)]
    return {name: fit(tmp_path_factory.mktemp(name.replace(" ", "-")), [*imported, *layout])
            for name, layout in runs.items()} | {"seed": fit(tmp_path_factory.mktemp("seed"), run)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", IMPORTED_LAYOUTS)
def test_an_imported_llama_trains_under_every_layout_as_one_process_does(imported_runs: dict[str, Path],
                                                                         layout: str) -> None:
    """The Llama family replicated, sharded per block (also with its activations recomputed in backward), split by
    its tensor-parallel plan (query, key/value and gate/up projections by columns: each rank keeps 2 query heads and
    their key/value head), cut into 2 pipeline stages, averaged by local SGD after every step, or served by the
    parameter server to one worker that may not run ahead, every rank having read its own slice of each tensor (or
    its stage's tensors only): the same validation loss and clipped gradient norm at every step, and the same
    weights (within the Adam bound), as one process that imported the folder; and not the run from the seed.
    (Gradient compression changes the numbers by design: tests/test_compression.py measures what it costs.)"""
    assert_comparable_runs_agree(imported_runs["one process"], imported_runs[layout])
    assert scalars(imported_runs["seed"], "val/loss")[0] != pytest.approx(
        scalars(imported_runs["one process"], "val/loss")[0], rel=1e-3)


@pytest.mark.slow
def test_an_imported_mixture_of_experts_trains_sharded_as_one_process_does(tmp_path: Path, byte_corpus: Path) -> None:
    """FSDP2 over 2 processes shards each stacked expert parameter by experts, each rank keeping its part of the
    stack read from the folder's expert tensors: the same losses, gradient norms and weights (within the Adam bound)
    as one process that imported the Mixtral folder."""
    run = ["-c", str(CONFIG_DIR / "moe-small/pretrain.yaml"), "--model.model_name", "debug", "--model.init_from",
           str(saved_reference("mixtral")[0]), "--data.data_dir", str(byte_corpus), "--data.sequence_length", "64",
           "--trainer.log_every_n_steps", "1", "--model.optimizer.warmup_steps", "2", "--model.max_new_tokens", "0",
           *COMPARABLE_RUN]
    assert_comparable_runs_agree(fit(tmp_path / "one", run), fit(tmp_path / "fsdp2", [*run, *MODEL_PARALLEL]))


FAMILIES = {  # a family built from a Hugging Face folder of the test size
    "llama": lambda folder: LlamaLanguageModel("debug", init_from=str(folder)),
    "gpt2": lambda folder: GPTLanguageModel("debug", init_from=str(folder)),
    "bert": lambda folder: BertMaskedLanguageModel("bert-tiny", vocab_size=256, init_from=str(folder)),
    "mixtral": lambda folder: MoELanguageModel("debug", init_from=str(folder)),
    "qwen3_moe": lambda folder: MoELanguageModel("debug-qwen3", init_from=str(folder)),
}
# float32 rounding of logits about 0.5 in size, summed in another order: about 1e-7 each
LOGITS_AGREE = 1e-5


def test_hugging_face_folders_give_the_logits_transformers_computes(tmp_path: Path) -> None:
    """LlamaForCausalLM, GPT2LMHeadModel, BertForMaskedLM, MixtralForCausalLM and Qwen3MoeForCausalLM of the test
    sizes, random weights, saved by the installed transformers (no download): the families built from the folders
    compute transformers' logits within float32 rounding (GPT-2's qkv rows are reordered head by head and its Conv1D
    weights transposed on the way in; each MoE expert parameter is stacked from one tensor per expert)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[hf]'")
    tokens = reference_tokens()
    for family, reference in reference_models(transformers).items():
        reference.eval().save_pretrained(tmp_path / family)
        network = FAMILIES[family](tmp_path / family).build().eval()
        with torch.no_grad():
            difference = (network(tokens) - reference(input_ids=tokens).logits).abs().max()
        assert difference < LOGITS_AGREE, (family, difference)


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_hugging_face_folders_give_the_logits_transformers_computed(family: str) -> None:
    """Without transformers: the folders it saved (tests/data/huggingface/), imported, give the logits it computed
    from them."""
    folder, tokens, logits = saved_reference(family)
    network = FAMILIES[family](folder).build().eval()
    with torch.no_grad():
        assert (network(tokens) - logits).abs().max() < LOGITS_AGREE


def test_the_saved_logits_are_what_transformers_computes() -> None:
    """The saved references are transformers' numbers, not stale ones: the installed transformers loads each saved
    folder and computes the saved logits."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[hf]'")
    for family, model_class in (("llama", "LlamaForCausalLM"), ("gpt2", "GPT2LMHeadModel"),
                                ("bert", "BertForMaskedLM"), ("mixtral", "MixtralForCausalLM"),
                                ("qwen3_moe", "Qwen3MoeForCausalLM")):
        if int(transformers.__version__.split(".")[0]) < 5 and family in ("mixtral", "qwen3_moe"):
            # transformers 5 saved them with keys 4 does not read (the RoPE base in rope_parameters only, Qwen3-MoE's
            # num_experts as num_local_experts): 4 builds them with its own defaults (base 1e6, 128 experts)
            continue
        folder, tokens, logits = saved_reference(family)
        model = getattr(transformers, model_class).from_pretrained(folder).eval()
        with torch.no_grad():
            assert (model(input_ids=tokens).logits - logits).abs().max() < LOGITS_AGREE, family


ROUND_TRIP_RECIPES = {  # each family's CPU recipe at the test size, whose network the saved folder holds
    "llama": ["-c", str(CONFIG_DIR / "llama-small/pretrain.yaml"), "--model.model_name", "debug",
              "--model.max_new_tokens", "0"],
    "gpt2": ["-c", str(CONFIG_DIR / "quickstart.yaml"), "--model.model_name", "debug", "--model.max_new_tokens", "0"],
    "bert": ["-c", str(CONFIG_DIR / "bert-small/pretrain.yaml"), "--model.model_name", "bert-tiny"],
    "mixtral": ["-c", str(CONFIG_DIR / "moe-small/pretrain.yaml"), "--model.model_name", "debug",
                "--model.max_new_tokens", "0"],
    "qwen3_moe": ["-c", str(CONFIG_DIR / "moe-small/pretrain.yaml"), "--model.model_name", "debug-qwen3",
                  "--model.max_new_tokens", "0"],
}
ROUND_TRIP_STEPS = 10


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory: pytest.TempPathFactory, byte_corpus: Path) -> Callable[[str], tuple[Path, Path]]:
    """family -> (the run that started from its saved folder and trained ROUND_TRIP_STEPS steps, the folder cohort
    export wrote from its last checkpoint), made the first time it is asked for."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in made:
            folder, _, _ = saved_reference(family)
            run = fit_in_process(tmp_path_factory.mktemp(f"{family}-run"), [
                *ROUND_TRIP_RECIPES[family], "--model.init_from", str(folder), "--data.data_dir", str(byte_corpus),
                "--data.sequence_length", "64", "--trainer.max_steps", str(ROUND_TRIP_STEPS), "--val_every_n_steps",
                str(ROUND_TRIP_STEPS), "--trainer.limit_val_batches", "1", *batch_sizes(8, 4)])
            exported = tmp_path_factory.mktemp(f"{family}-export") / "hf"
            with pytest.MonkeyPatch.context() as monkeypatch:
                monkeypatch.setattr("sys.argv", ["cohort"])
                main(["export", str(last_checkpoint(run)), "--out", str(exported)])
            made[family] = run, exported
        return made[family]

    return get


def trained_network(family: str, run: Path) -> nn.Module:
    """The run's last weights in the family's plain network."""
    network = FAMILIES[family](None).plain_network().eval()
    network.load_state_dict({name.removeprefix("model."): tensor for name, tensor in
                             last_checkpoint_contents(run)["state_dict"].items()})
    return network


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_imported_trained_and_exported_holds_what_transformers_saved(
        family: str, round_trips: Callable[[str], tuple[Path, Path]]) -> None:
    """Without transformers: a saved folder -> cohort fit from it (ROUND_TRIP_STEPS steps) -> cohort export writes
    the tensors transformers saved, by name, shape and dtype, holding the trained weights: imported again, they
    compute the trained network's logits exactly, which the saved folder's are not."""
    run, exported = round_trips(family)
    folder, tokens, imported_logits = saved_reference(family)
    assert shapes_in(exported) == shapes_in(folder)
    with torch.no_grad():
        logits = trained_network(family, run)(tokens)
        assert torch.equal(FAMILIES[family](exported).build().eval()(tokens), logits)
        assert (logits - imported_logits).abs().max() > 1e-3  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_imported_trained_and_exported_loads_in_transformers(
        family: str, round_trips: Callable[[str], tuple[Path, Path]]) -> None:
    """The round trip's export loads in transformers with nothing missing or left over, and computes the trained
    Cohort network's logits within float32 rounding."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[hf]'")
    run, exported = round_trips(family)
    _, tokens, _ = saved_reference(family)
    loader = getattr(transformers, json.loads((exported / "config.json").read_text())["architectures"][0])
    model, loading = loader.from_pretrained(exported, output_loading_info=True)
    assert not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
    with torch.no_grad():
        assert (model.eval()(input_ids=tokens).logits - trained_network(family, run)(tokens)).abs().max() < LOGITS_AGREE


def shapes_in(folder: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each tensor of a folder's model.safetensors: its shape and dtype."""
    tensors = load_file(folder / "model.safetensors")
    return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in tensors.items()}
