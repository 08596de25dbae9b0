"""The BERT family: the LightningModule that pretrains a BERT (models/bert/network.py) with the masked-language-model
objective (no next-sentence objective: RoBERTa showed it does not help), on the same token files as the GPT.

Each (B, T) window of the data becomes one sequence: [CLS], the window's tokens 1 .. T-2, [SEP]. Its corruption
(models/bert/masking.py) is drawn from a generator seeded by (seed, optimizer step, the micro-batch's place in the
step's global batch), so masks differ across ranks and steps, a resumed run masks exactly as the uninterrupted one
did, and a run on 2 processes masks its samples as a run on 1 does. A validation sample's masks follow from (seed, its
place among the chosen validation samples), drawn on the CPU: the same in every validation, at any world size, on any
device, so that validation losses of runs on 1 CPU and on N GPUs compare.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from jsonargparse import Namespace

from core.errors import UserError, check_ranges
from core.run_plan import RunPlan, run_plan_of
from core.seeding import DEFAULT_SEED, derive_seed
from core.tokens import BYTE_BERT_VOCAB_SIZE, BYTE_SPECIAL_TOKENS, BYTE_VOCAB_SIZE, IGNORE_INDEX, SpecialTokens
from models.bert.huggingface import BERT_HUGGING_FACE
from models.bert.masking import check_special_tokens, mask_tokens
from models.bert.network import BERT, bert_config
from models.interchange import HuggingFaceFolder
from models.module import CohortModule
from models.optimizer import OptimizerSettings
from models.parallel.parallelize import TensorParallelPlan
from models.parallel.pipeline import PipelineSplit

# BERT's: 1e-4 at batch 256, warmed up over 10,000 steps, decayed to 0, weight decay 0.01, Adam's betas
BERT_OPTIMIZER = OptimizerSettings(learning_rate=1e-4, min_learning_rate_ratio=0.0, weight_decay=0.01,
                                   betas=(0.9, 0.999), warmup_steps=10_000)
# as GPT's (models/gpt/family.py): query, key and value by output columns (whole heads), the attention output
# and the second feed-forward layer by input rows; embeddings, norms and the MLM head stay replicated
# the first stage turns (masked) token ids into hidden states, the last the final hidden states into logits; the
# last stage also keeps the token embedding, which its decoder shares
BERT_PIPELINE_SPLIT = PipelineSplit(
    first=("token_embedding", "position_embedding", "token_type_embedding", "ln_embedding", "drop"), last=("head",),
    embed=BERT.embed, head=lambda network, x: network.head(x))
BERT_TENSOR_PARALLEL_PLAN: TensorParallelPlan = {
    "blocks.*.attn.query": "colwise", "blocks.*.attn.key": "colwise", "blocks.*.attn.value": "colwise",
    "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}


class BertMaskedLanguageModel(CohortModule):
    label = "BERT"
    huggingface = BERT_HUGGING_FACE
    logs_perplexity = True
    def __init__(
        self,
        model_name: str = "bert-small",
        vocab_size: int | None = None,
        init_from: str | None = None,
        mask_token_id: int | None = None,
        cls_token_id: int | None = None,
        sep_token_id: int | None = None,
        pad_token_id: int | None = None,
        mask_probability: float = 0.15,
        dropout: float = 0.1,
        activation_checkpointing: bool = False,
        compile: bool = False,
        optimizer: OptimizerSettings = BERT_OPTIMIZER,
        seed: int = DEFAULT_SEED,
    ) -> None:
        """
        Args:
            model_name: a size from models.bert.network.BERT_CONFIGS ("bert-tiny", "bert-small", "bert-base",
                "bert-large").
            vocab_size: the data's vocabulary; the CLI links it to data.vocab_size. Byte-level data (256) gets the four
                special tokens after the bytes (core/tokens.py), a vocabulary of 260.
            init_from: a local Hugging Face BertForMaskedLM folder (config.json, model.safetensors or its shards) of
                this size whose weights the run starts from (models/bert/huggingface.py); None: initial weights from the
                seed.
            mask_token_id, cls_token_id, sep_token_id, pad_token_id: the special tokens' ids in a tokenizer's
                vocabulary; leave them null for byte-level data.
            mask_probability: the share of (non-special) tokens chosen for prediction; BERT's is 0.15.
            dropout: dropout probability in embeddings, attention and feed-forward layers (BERT: 0.1).
            activation_checkpointing: recompute each block's activations in backward instead of keeping them.
            compile: torch.compile each block.
            optimizer: AdamW and its schedule (models/optimizer.py); a field given keeps the others' defaults.
            seed: initial weights and masks follow from it; the CLI links it to seed_everything.
        """
        super().__init__(optimizer)
        self.save_hyperparameters()
        check_ranges("model", {"dropout": (0 <= dropout < 1, "in [0, 1)")}, locals())
        self.special_tokens, model_vocab_size = special_tokens(vocab_size, mask_token_id, cls_token_id, sep_token_id,
                                                               pad_token_id, mask_probability)
        self.config = bert_config(model_name, vocab_size=model_vocab_size, dropout=dropout)
        self.validation_samples_read = 0  # by this rank in this validation: where its next micro-batch starts

    # ----- the family's part of CohortModule -----
    def plain_network(self) -> BERT:
        return BERT(self.config)

    def example_batch(self, micro_batch_size: int, sequence_length: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.zeros(micro_batch_size, sequence_length, dtype=torch.long, device=device)
        return tokens, tokens.clone()  # inputs and labels: two tensors, as masking makes (the memory estimate counts both)

    def batch_loss(self, network: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.batch_metrics(network, batch)[0]

    def batch_metrics(self, network: nn.Module,
                      batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss on the tokens chosen for prediction; in validation also the share of them predicted right
        (``masked_accuracy``). Under a pipeline validation has the loss alone: the logits stay on the last stage."""
        inputs, labels = batch
        logits = self.float_in_evaluation(network(inputs))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        if self.training:
            return loss, {}
        chosen = labels != IGNORE_INDEX
        return loss, {"masked_accuracy": (logits[chosen].argmax(-1) == labels[chosen]).float().mean()}

    def prepare_batch(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[CLS] window [SEP], masked: in training by the micro-batch's place in the step's global batch
        (``mask_seed``), in validation sample by sample (``validation_masked``). Padding windows (all their targets
        IGNORE_INDEX) get no labels."""
        plan, window = run_plan_of(self), batch[0]
        if self.trainer.training:
            inputs, labels = self.masked(window, self.mask_seed(plan, self.global_rank, self.global_step, batch_idx))
        else:
            first = self.validation_samples_read
            self.validation_samples_read += len(window)
            inputs, labels = self.validation_masked(window, plan, plan.data_parallel_rank(self.global_rank), first)
        return inputs, labels.masked_fill(batch[1] == IGNORE_INDEX, IGNORE_INDEX)

    def pipeline_split(self) -> PipelineSplit:
        return BERT_PIPELINE_SPLIT

    @classmethod
    def check_config(cls, model: Namespace, data: Namespace, plan: RunPlan) -> None:
        config = bert_config(model.model_name)
        name = f"model '{model.model_name}'"
        cls.check_layers_and_heads(plan, config.n_layer, (config.n_head,), name)
        if data.sequence_length > config.max_position_embeddings:
            raise UserError(f"data.sequence_length={data.sequence_length} exceeds the {config.max_position_embeddings} "
                            f"positions of {name}: shorten the sequences or pick a larger model")
        if data.sequence_length < 3:
            raise UserError(f"data.sequence_length={data.sequence_length}: a BERT sequence needs [CLS], at least one "
                            "token and [SEP]")
        if model.init_from is not None:
            _, vocab_size = special_tokens(data.vocab_size, model.mask_token_id, model.cls_token_id, model.sep_token_id,
                                           model.pad_token_id, model.mask_probability)
            cls.huggingface.check_pretrained(HuggingFaceFolder(model.init_from),
                                             bert_config(model.model_name, vocab_size=vocab_size), model.model_name)

    def describe(self) -> str:
        c = self.config
        return (f"{self.label} '{self.hparams.model_name}' (masked LM), {c.n_layer} layers x {c.n_head} heads, width {c.n_embd}, "
                f"{c.max_position_embeddings} positions, vocabulary {c.vocab_size}: {self.parameters_and_size()}")

    # ----- training -----
    def tensor_parallel_plan(self) -> TensorParallelPlan:
        return BERT_TENSOR_PARALLEL_PLAN

    def masked(self, window: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[CLS] window[1:-1] [SEP], corrupted as BERT does, and the labels."""
        tokens = window.clone()
        tokens[:, 0], tokens[:, -1] = self.special_tokens.cls, self.special_tokens.sep
        generator = torch.Generator(device=tokens.device).manual_seed(seed)
        return mask_tokens(tokens, generator, self.config.vocab_size, self.special_tokens.mask,
                           self.special_tokens.ids, self.hparams.mask_probability)

    @staticmethod
    def mask_seed(plan: RunPlan, global_rank: int, step: int, batch_idx: int) -> int:
        """The seed of a training micro-batch's masks, from its place in the step's global batch (its
        ``RunPlan.micro_batch_group``). So ranks and steps mask differently, ranks of one tensor-parallel group
        alike, and the same samples get the same masks at any world size with the same micro batch."""
        group = plan.micro_batch_group(plan.data_parallel_rank(global_rank), plan.micro_batch_in_step(batch_idx))
        return derive_seed(plan.seed, "mask", step, group)

    def on_validation_epoch_start(self) -> None:
        self.validation_samples_read = 0

    def validation_masked(self, window: torch.Tensor, plan: RunPlan, data_parallel_rank: int,
                          first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``masked`` for a validation micro-batch whose samples are ``data_parallel_rank``'s ``first``-th, next, ...
        in its share, each with its own seed: (seed, the sample's place among the chosen validation samples,
        ``RunPlan.evaluation_place``), which names the same sample at any world size. Drawn on the CPU, whose generator
        does not depend on the device the run uses (a copy of a few kilobytes per validation micro-batch)."""
        rows = [self.masked(row[None], derive_seed(plan.seed, "validation mask",
                                                   plan.evaluation_place(data_parallel_rank, first + i)))
                for i, row in enumerate(window.cpu())]
        inputs, labels = (torch.cat(parts).to(window.device) for parts in zip(*rows))
        return inputs, labels


def special_tokens(vocab_size: int | None, mask_token_id: int | None, cls_token_id: int | None,
                   sep_token_id: int | None, pad_token_id: int | None,
                   mask_probability: float) -> tuple[SpecialTokens, int]:
    """The special tokens and the model's vocabulary: byte-level data (256 ids) gets the four ids after the bytes;
    a tokenizer's vocabulary must name its own."""
    ids = (mask_token_id, cls_token_id, sep_token_id, pad_token_id)
    if vocab_size in (None, BYTE_VOCAB_SIZE) and all(token_id is None for token_id in ids):
        check_special_tokens(BYTE_BERT_VOCAB_SIZE, *BYTE_SPECIAL_TOKENS.ids, mask_probability)
        return BYTE_SPECIAL_TOKENS, BYTE_BERT_VOCAB_SIZE
    check_special_tokens(vocab_size, *ids, mask_probability)
    return SpecialTokens(*ids), vocab_size
