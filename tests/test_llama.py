"""The Llama family (models/llama/network.py, models/llama/family.py): its parts do what the architecture says, its
named sizes are the published ones, it computes what Hugging Face's LlamaForCausalLM computes from the same
tensors (where transformers is installed), and the doctor sizes its 8B recipe. It trains under every layout as one
process does in tests/test_pretrained.py, from an imported folder."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from app.tools.doctor import main as doctor
from models.llama.family import LlamaLanguageModel
from models.llama.network import LLAMA_CONFIGS, Attention, Llama, LlamaConfig, llama3_scaled, rotary_tables, rotate
from tests.helpers import CONFIG_DIR

TINY = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64, block_size=16, vocab_size=64)


def test_the_named_sizes_have_the_published_parameter_counts() -> None:
    """Llama 3.2 1B (tied head) and Llama 3.1 8B, counted on the meta device."""
    with torch.device("meta"):
        counts = {name: sum(p.numel() for p in Llama(LLAMA_CONFIGS[name]).parameters()) for name in ("1b", "8b")}
    assert counts == {"1b": 1_235_814_400, "8b": 8_030_261_248}


def test_rotary_scores_depend_on_the_distance_between_positions_only() -> None:
    """q at position m against k at position n scores the same as at m + s and n + s: RoPE encodes m - n."""
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 8, generator=generator).unbind(0)  # (1, 1, hs) each
    cos, sin = rotary_tables(12, 8, 10000.0, torch.device("cpu"))

    def score(m: int, n: int) -> torch.Tensor:
        return (rotate(q, cos[m], sin[m]) * rotate(k, cos[n], sin[n])).sum()

    assert torch.allclose(score(3, 1), score(10, 8), atol=1e-5)
    assert not torch.allclose(score(3, 1), score(3, 2), atol=1e-3)
    assert torch.allclose(rotate(q, cos[0], sin[0]), q)  # position 0 turns nothing


def test_grouped_query_attention_shares_each_key_value_head_within_its_group() -> None:
    """The module's output equals causal attention with each of the 2 key/value heads repeated for its 2 query
    heads (rotary positions applied to queries and keys)."""
    torch.manual_seed(0)
    attention = Attention(TINY)
    x = torch.randn(3, 10, TINY.n_embd)
    q = attention.q_proj(x).view(3, 10, 4, 8).transpose(1, 2)
    k = attention.k_proj(x).view(3, 10, 2, 8).transpose(1, 2)
    v = attention.v_proj(x).view(3, 10, 2, 8).transpose(1, 2)
    cos, sin = rotary_tables(10, 8, TINY.rope_base, x.device)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-2, -1) / 8**0.5
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    expected = attention.o_proj((scores.softmax(-1) @ v.repeat_interleave(2, dim=1)).transpose(1, 2).reshape(3, 10, -1))
    assert torch.allclose(attention(x), expected, atol=1e-5)


def test_torchs_flop_count_is_the_formula() -> None:
    """6N over the matmul weights + 12·L·H·Q·T: torch's counter on the meta device agrees to the FLOP, so MFU is
    as right for this family as for the GPT."""
    family = LlamaLanguageModel("debug")
    assert family.flops_per_sample(64) == family.training_flops_per_token(64) * 64 == 13_369_344


def test_a_sequence_longer_than_the_context_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the model's block_size 16"):
        Llama(TINY)(torch.zeros(1, 17, dtype=torch.long))


def test_llama3_scaling_keeps_the_fast_frequencies_and_slows_the_slow_ones() -> None:
    """Frequencies whose wavelength is under trained_context / high_freq_factor stay, those over trained_context /
    low_freq_factor are divided by the factor, those between lie between."""
    frequencies = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    scaled = llama3_scaled(frequencies, 8.0, 1.0, 4.0, 64)
    wavelengths = 2 * math.pi / frequencies
    fast, slow = wavelengths < 64 / 4, wavelengths > 64 / 1
    assert fast.any() and slow.any() and (~fast & ~slow).any()
    assert torch.equal(scaled[fast], frequencies[fast])
    assert torch.allclose(scaled[slow], frequencies[slow] / 8)
    between = ~fast & ~slow
    assert ((scaled[between] < frequencies[between]) & (scaled[between] > frequencies[between] / 8)).all()


LLAMA3_SCALING = (8.0, 1.0, 4.0, 8)  # a trained context of 8 positions, so that 16 positions reach the scaling


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["plain-rope", "llama3-rope"])
def test_hugging_face_llama_computes_the_same_logits_from_the_same_tensors(
        scaling: tuple[float, float, float, int] | None) -> None:
    """Hugging Face's LlamaForCausalLM (rotate-half RoPE, as Cohort's; with and without Llama 3's scaling) with
    random weights from the same config: its state dict, less the ``model.`` prefix, is Cohort's, and the logits
    agree to float32 rounding."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[hf]'")
    torch.manual_seed(0)
    config = replace(TINY, rope_scaling=scaling)
    rope = {"rope_type": "default"} if scaling is None else dict(zip(
        ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        ("llama3", *scaling)))
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=TINY.vocab_size, hidden_size=TINY.n_embd, intermediate_size=TINY.intermediate_size,
        num_hidden_layers=TINY.n_layer, num_attention_heads=TINY.n_head, num_key_value_heads=TINY.n_kv_head,
        max_position_embeddings=TINY.block_size, rope_theta=TINY.rope_base, rms_norm_eps=TINY.norm_eps,
        rope_scaling={**rope, "rope_theta": TINY.rope_base}, tie_word_embeddings=False,
        attn_implementation="eager")).eval()
    ours = Llama(config).eval()
    ours.load_state_dict({name.removeprefix("model."): tensor for name, tensor in reference.state_dict().items()
                          if not name.endswith("rotary_emb.inv_freq")})
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.block_size), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, logits = reference(input_ids=tokens).logits, ours(tokens)
    assert (logits - expected).abs().max() < 1e-5, (logits - expected).abs().max()


@pytest.mark.parametrize("preset, fits", [("model_parallel_gpu_bf16", True), ("ddp_gpu_bf16", False)],
                         ids=["fsdp2-8-gpus", "ddp-8-gpus"])
def test_the_doctor_answers_whether_the_8b_continued_pretraining_fits_80_gb_gpus(
        preset: str, fits: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe's 8B sharded over 8 GPUs fits in 80 GB each (parameters, gradients and Adam state are an eighth of
    about 120 GB); replicated by DDP it cannot (the whole 120 GB on every GPU). This machine has no GPU, no token
    files and no Llama folder, so the doctor fails those checks (the run plan's with the folder); the memory line is
    the point, given whatever else fails."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        doctor(["-c", str(CONFIG_DIR / f"trainer/{preset}.yaml"), "-c",
                str(CONFIG_DIR / "llama-8b/continued_pretraining.yaml"), "--trainer.devices", "8",
                "--device_memory", "80GiB"])
    output = capsys.readouterr().out
    assert "FAIL  run plan         model.init_from=models/Llama-3.1-8B is not a Hugging Face model folder" in output
    line = next(line for line in output.splitlines() if " memory " in line)
    needed = float(re.search(r"needs ([0-9.]+) GiB", line).group(1))
    if fits:
        assert line.startswith("PASS") and 8_030_261_248 * 16 / 8 / 2**30 < needed < 80, line
    else:
        assert line.startswith("FAIL") and needed > 8_030_261_248 * 16 / 2**30, line
