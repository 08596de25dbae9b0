"""The BERT module (sizes, shapes, padding, weight tying, initialisation), built by Cohort in one process, and the
masked-LM corruption (proportions, special tokens, the generator) with its config checks."""

from __future__ import annotations

import pytest
import torch

from core.errors import UserError
from core.tokens import BYTE_BERT_VOCAB_SIZE, BYTE_SPECIAL_TOKENS, IGNORE_INDEX
from models.bert.masking import check_special_tokens, mask_tokens
from models.bert.network import BERT, BERT_CONFIGS, BertConfig, bert_config
from models.parallel.parallelize import build_network, init_weights

TINY = BERT_CONFIGS["bert-tiny"]


def build_bert(config: BertConfig, device: torch.device, seed: int, **options: object) -> BERT:
    """A BERT as Cohort builds it (on the meta device, then materialised and initialised), in this process."""
    return build_network(lambda: BERT(config), device, seed, **options)


def masked_lm_parameters(config: BertConfig) -> int:
    """BERT's parameter count from its architecture (as Hugging Face's BertForMaskedLM: no pooler, the decoder's
    weight tied to the token embedding and counted once, its bias counted)."""
    C, I, V = config.n_embd, config.intermediate_size, config.vocab_size

    def linear(n_in: int, n_out: int) -> int:
        return n_in * n_out + n_out

    layer_norm = 2 * C
    embeddings = (V + config.max_position_embeddings + config.type_vocab_size) * C + layer_norm
    block = 4 * linear(C, C) + linear(C, I) + linear(I, C) + 2 * layer_norm  # q, k, v, out; FFN in, out; 2 norms
    head = linear(C, C) + layer_norm + V  # dense, norm, the decoder's own bias
    return embeddings + config.n_layer * block + head


@pytest.mark.parametrize(("name", "count"), [("bert-base", 109_514_298), ("bert-large", 335_174_458)])
def test_released_sizes_have_exactly_bert_parameter_counts(name: str, count: int) -> None:
    assert masked_lm_parameters(BERT_CONFIGS[name]) == count  # the formula agrees with the published count
    with torch.device("meta"):  # no memory, no init cost
        model = BERT(BERT_CONFIGS[name])
    assert model.num_parameters() == count


@pytest.mark.parametrize("name", sorted(BERT_CONFIGS))
def test_every_named_size_builds_with_the_architectures_parameter_count(name: str) -> None:
    with torch.device("meta"):
        model = BERT(BERT_CONFIGS[name])
    assert model.num_parameters() == masked_lm_parameters(BERT_CONFIGS[name])
    assert list(model.blocks) == [str(index) for index in range(BERT_CONFIGS[name].n_layer)]


def test_unknown_size_is_a_user_error_listing_the_sizes() -> None:
    with pytest.raises(UserError, match="unknown model.model_name 'bert-huge': choose one of bert-tiny, bert-small, "
                                        "bert-base, bert-large$"):
        bert_config("bert-huge")
    assert bert_config("bert-tiny", dropout=0.0, n_layer=None) == BertConfig(**{**TINY.__dict__, "dropout": 0.0})


def test_the_byte_level_sizes_hold_the_bytes_and_the_special_tokens() -> None:
    assert sorted(BYTE_SPECIAL_TOKENS.ids) == list(range(256, BYTE_BERT_VOCAB_SIZE))
    assert BERT_CONFIGS["bert-tiny"].vocab_size == BERT_CONFIGS["bert-small"].vocab_size == BYTE_BERT_VOCAB_SIZE


def test_forward_and_backward_shapes() -> None:
    model = BERT(TINY)
    input_ids = torch.randint(0, TINY.vocab_size, (3, 17))
    logits = model(input_ids, torch.ones(3, 17, dtype=torch.long), torch.randint(0, 2, (3, 17)))
    assert logits.shape == (3, 17, TINY.vocab_size)
    logits.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_padded_keys_do_not_change_the_real_tokens_outputs() -> None:
    model = BERT(TINY).eval()
    input_ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    attention_mask[0, 8:] = 0  # the first sequence is 8 tokens, then padding
    other_padding = input_ids.clone()
    other_padding[0, 8:] = (input_ids[0, 8:] + 1) % 256
    masked, masked_other = model(input_ids, attention_mask), model(other_padding, attention_mask)
    torch.testing.assert_close(masked_other[0, :8], masked[0, :8], rtol=0, atol=0)
    torch.testing.assert_close(masked_other[1], masked[1], rtol=0, atol=0)  # no padding in the second sequence
    # without the mask the same change reaches every position: the comparison above can fail
    assert not torch.allclose(model(other_padding)[0, :8], model(input_ids)[0, :8])


def test_attention_is_bidirectional_and_token_types_count() -> None:
    model = BERT(TINY).eval()
    input_ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    changed = input_ids.clone()
    changed[0, -1] = (input_ids[0, -1] + 1) % 256
    assert not torch.allclose(model(changed)[0, 0], model(input_ids)[0, 0])  # the first token sees the last
    assert not torch.allclose(model(input_ids, token_type_ids=torch.ones_like(input_ids)), model(input_ids))


def test_longer_than_the_position_table_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 64"):
        BERT(TINY)(torch.zeros(1, TINY.max_position_embeddings + 1, dtype=torch.long))


def test_decoder_weight_is_the_token_embedding() -> None:
    model = BERT(TINY)
    assert model.head.decoder.weight is model.token_embedding.weight
    built = build_bert(TINY, torch.device("cpu"), seed=0)  # still tied after materialising from the meta device
    assert built.head.decoder.weight is built.token_embedding.weight
    assert built.head.decoder.bias is not None and built.head.decoder.bias.shape == (TINY.vocab_size,)


def test_initialisation_is_berts() -> None:
    model = build_bert(bert_config("bert-small", n_embd=256), torch.device("cpu"), seed=0)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            assert torch.all(param == 0), name
        elif ".ln" in name or name.startswith("ln"):
            assert torch.all(param == 1), name
        else:
            assert param.std().item() == pytest.approx(0.02, rel=0.05), name
    norms = [name for name, module in model.named_modules() if isinstance(module, torch.nn.LayerNorm)]
    assert len(norms) == 2 * 4 + 2 and all(model.initial_std(f"{name}.weight") is None for name in norms)


def test_the_seed_alone_decides_the_initial_weights() -> None:
    first, again, other = (build_bert(TINY, torch.device("cpu"), seed) for seed in (1, 1, 2))
    torch.manual_seed(123)  # the global generator plays no part
    wrapped = build_bert(TINY, torch.device("cpu"), 1, activation_checkpointing=True)
    direct = BERT(TINY)  # built on the CPU, not the meta device
    init_weights(direct, seed=1)
    for name, weight in first.state_dict().items():
        assert torch.equal(weight, again.state_dict()[name]), name
        assert torch.equal(weight, wrapped.state_dict()[name]), name
        assert torch.equal(weight, direct.state_dict()[name]), name
    different = [name for name, weight in first.named_parameters()
                 if weight.std() > 0 and torch.equal(weight, dict(other.named_parameters())[name])]
    assert different == []


# masking

VOCAB = BYTE_BERT_VOCAB_SIZE
SPECIAL = BYTE_SPECIAL_TOKENS


def byte_tokens(count: int, seed: int = 0) -> torch.Tensor:
    """(count // 100, 100) ordinary byte ids with [CLS] first and [SEP] last in every row, [PAD] in some."""
    tokens = torch.randint(0, 256, (count // 100, 100), generator=torch.Generator().manual_seed(seed))
    tokens[:, 0], tokens[:, -1] = SPECIAL.cls, SPECIAL.sep
    tokens[::3, 90:-1] = SPECIAL.pad
    return tokens


def masked(tokens: torch.Tensor, seed: int, probability: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    return mask_tokens(tokens, torch.Generator().manual_seed(seed), VOCAB, SPECIAL.mask, SPECIAL.ids, probability)


def test_masking_follows_berts_proportions() -> None:
    """A million tokens (about 950k ordinary, 140k chosen): each tolerance below is about 6 standard deviations of
    its proportion, so a correct implementation cannot fail whatever the seed, and an error of one percentage
    point in any proportion cannot pass."""
    tokens = byte_tokens(1_000_000)
    inputs, labels = masked(tokens, seed=1)
    ordinary = tokens < 256
    chosen = labels != IGNORE_INDEX
    assert chosen.sum() / ordinary.sum() == pytest.approx(0.15, abs=0.0025)
    to_mask = (inputs == SPECIAL.mask).sum() / chosen.sum()
    unchanged = (inputs == tokens)[chosen].float().mean()  # a random draw can give the same token back: 1 in 256
    assert to_mask == pytest.approx(0.8, abs=0.0065)
    assert unchanged == pytest.approx(0.1 + 0.1 / 256, abs=0.005)
    assert 1 - to_mask - unchanged == pytest.approx(0.1 * 255 / 256, abs=0.005)  # replaced by another token


def test_special_tokens_are_never_chosen_and_labels_hold_the_originals() -> None:
    tokens = byte_tokens(20_000)
    inputs, labels = masked(tokens, seed=2, probability=0.5)
    special = tokens >= 256
    chosen = labels != IGNORE_INDEX
    assert not chosen[special].any()
    assert torch.equal(labels[chosen], tokens[chosen])
    assert torch.equal(inputs[~chosen], tokens[~chosen])  # only chosen positions change
    assert torch.equal(inputs[special], tokens[special])


def test_random_replacements_cover_the_ordinary_vocabulary_only() -> None:
    """Special ids scattered through a small vocabulary: every other id, and only those, is drawn."""
    special_ids, vocab_size = (0, 5, 6, 19), 20
    tokens = torch.full((50_000,), 1)
    inputs, labels = mask_tokens(tokens, torch.Generator().manual_seed(3), vocab_size, mask_token_id=5,
                                 special_token_ids=(0, 6, 19), probability=0.9)
    replaced = set(inputs[(labels != IGNORE_INDEX) & (inputs != 5)].tolist())
    assert replaced == set(range(vocab_size)) - set(special_ids)


def test_the_generator_decides_the_masking() -> None:
    tokens = byte_tokens(10_000)
    first, again, other = (masked(tokens, seed) for seed in (7, 7, 8))
    torch.manual_seed(0)  # the global generator plays no part
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[1], other[1]) and not torch.equal(first[0], other[0])


def test_byte_special_tokens_pass_the_checks() -> None:
    check_special_tokens(VOCAB, SPECIAL.mask, SPECIAL.cls, SPECIAL.sep, SPECIAL.pad, mask_probability=0.15)


@pytest.mark.parametrize(("field", "value", "requirement"), [
    ("mask_token_id", None, r"a token id in \[0, 260\)"),
    ("cls_token_id", 260, r"a token id in \[0, 260\)"),
    ("sep_token_id", -1, r"a token id in \[0, 260\)"),
    ("pad_token_id", None, r"a token id in \[0, 260\)"),
    ("mask_probability", 0.0, "between 0 and 1, exclusive"),
    ("mask_probability", 1.0, "between 0 and 1, exclusive"),
])
def test_unusable_masking_settings_are_one_line_user_errors(field: str, value: object, requirement: str) -> None:
    settings = {"mask_token_id": SPECIAL.mask, "cls_token_id": SPECIAL.cls, "sep_token_id": SPECIAL.sep,
                "pad_token_id": SPECIAL.pad, "mask_probability": 0.15, field: value}
    with pytest.raises(UserError, match=rf"^model\.{field}={value!r} must be {requirement}") as error:
        check_special_tokens(VOCAB, **settings)
    assert "\n" not in str(error.value)
