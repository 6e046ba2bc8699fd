"""windserve-tiny: a small GPT-OSS-shaped model generated locally, never downloaded.

It is the default model of tests and examples. Everything in its directory is
made by this file from a fixed seed, so two machines (or two Ray actors racing
on one machine) build byte-identical weights:

    <cache>/windserve-tiny-v1/
        config.json              GptOssConfig: 4 layers, sliding/full alternating
        generation_config.json   eos = <|endoftext|> and <|end|>
        model.safetensors        float32, seed 0, sorted parameter order
        tokenizer.json           256 byte tokens + special tokens (ids 256..)
        tokenizer_config.json    special tokens and the chat template
        special_tokens_map.json

Bump ``TINY_MODEL_DIRNAME`` whenever any of these bytes change.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from engine.model_cache import default_cache_dir, write_atomically
from engine.models import build_model

TINY_MODEL_NAME = "windserve-tiny"
TINY_MODEL_DIRNAME = "windserve-tiny-v1"
SEED = 0

EOS_TOKEN, BOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|startoftext|>", "<|pad|>"
START_TOKEN, END_TOKEN = "<|start|>", "<|end|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN, PAD_TOKEN, START_TOKEN, END_TOKEN) + tuple(f"<|{r}|>" for r in ROLES)
NUM_BYTE_TOKENS = 256
VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)


def token_id(token: str) -> int:
    """Id of a special token: byte tokens are 0..255 (id == byte), specials follow."""
    return NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(token)


# One message renders as <|start|><|role|>content<|end|>; the generation
# prompt is <|start|><|assistant|>. Content may be a string or OpenAI-style
# parts, of which only text parts are kept.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('windserve-tiny supports system, user and assistant roles, got ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|start|><|' + message['role'] + '|>' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|><|assistant|>' -}}{%- endif -%}"
)


def tiny_config_dict() -> dict:
    """config.json of windserve-tiny.

    The rope parameters are GPT-OSS's own (YaRN, factor 32 over 4096), so an
    engine exercises the real YaRN numbers; only the context cap is small.
    """
    num_layers = 4
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        "sliding_window": 32,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "rms_norm_eps": 1e-05,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "initializer_range": 0.02,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": token_id(BOS_TOKEN),
        "eos_token_id": token_id(EOS_TOKEN),
        "pad_token_id": token_id(PAD_TOKEN),
        "dtype": "float32",
    }


def param_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the engine's model for ``cfg``: ``transformers``' state-dict names.

    Built on the meta device, so nothing is allocated; a test checks them against transformers.
    """
    from transformers import GptOssConfig

    model = build_model(GptOssConfig(**cfg), device="meta")
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def _init_std(name: str, shape: tuple[int, ...]) -> float:
    """Unit-scale activations (std 1/sqrt(fan_in)) so attention and experts matter.

    With HF's 0.02 everywhere the residual stream is the embedding alone and
    the next token depends on the last token only: a KV cache bug would then
    not change what the model generates.
    """
    if name.endswith("embed_tokens.weight"):
        return 1.0
    if name.endswith(("bias", "sinks")):
        return 0.1
    if name.endswith("gate_up_proj") or name.endswith("down_proj"):
        return shape[1] ** -0.5  # experts store (experts, in, out)
    return shape[-1] ** -0.5  # nn.Linear stores (out, in)


def tiny_weights(cfg: dict, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights: one generator, parameters in sorted-name order."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in sorted(param_shapes(cfg).items()):
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            # Near 1, not exactly 1, so an engine that ignores a norm weight differs.
            weights[name] = 1.0 + 0.1 * noise
        else:
            weights[name] = noise * _init_std(name, shape)
    return weights


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in printable)
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return chars


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: token id == byte value, specials after 255."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def _tokenizer_config() -> dict:
    added = {
        str(token_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False, sort_keys=True)
        f.write("\n")


def write_tiny_model(directory: str) -> None:
    """Write every file of windserve-tiny into an existing, empty ``directory``."""
    cfg = tiny_config_dict()
    _write_json(os.path.join(directory, "config.json"), cfg)
    _write_json(os.path.join(directory, "generation_config.json"), {
        "bos_token_id": token_id(BOS_TOKEN),
        "eos_token_id": [token_id(EOS_TOKEN), token_id(END_TOKEN)],
        "pad_token_id": token_id(PAD_TOKEN),
    })
    save_file(tiny_weights(cfg), os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer().save(os.path.join(directory, "tokenizer.json"))
    _write_json(os.path.join(directory, "tokenizer_config.json"), _tokenizer_config())
    _write_json(os.path.join(directory, "special_tokens_map.json"),
                {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN})


def ensure_tiny_model(cache_dir: str | None = None) -> str:
    """Return windserve-tiny's directory, creating it on first use (engine.model_cache)."""
    target = os.path.join(os.path.abspath(cache_dir or default_cache_dir()), TINY_MODEL_DIRNAME)
    if not os.path.isdir(target):
        write_atomically(target, write_tiny_model)
    return target

