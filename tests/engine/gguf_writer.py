"""Small GGUF files written the way llama.cpp's converter writes them, from a Hugging Face state dict.

    HF name                                   GGUF name (gguf's own TensorNameMap)
    model.embed_tokens.weight             ->  token_embd.weight
    model.layers.{i}.self_attn.q_proj.*   ->  blk.{i}.attn_q.*     (rows permuted for llama, see below)
    model.norm.weight / lm_head.weight    ->  output_norm.weight / output.weight (absent when tied)

llama.cpp's llama arch rotates interleaved pairs (GPT-J style), HF rotates
halves: its converter reorders q/k rows per head from [half 0 | half 1] to
[r0 of half 0, r0 of half 1, r1 of half 0, ...]; transformers undoes this on load.
Qwen2 is converted unpermuted (llama.cpp runs it with NeoX, halves, rotation).

Tokenizer: a byte-level BPE (token id == byte for 0..255), three merges and
the ChatML specials, with a ChatML chat template.
"""

from __future__ import annotations

import numpy as np
import torch

BYTE_MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"))  # "Ġthe" is one token
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in printable)
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return chars


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens and their llama.cpp types: 256 bytes, the merged tokens, then the specials."""
    tokens = [bytes_to_unicode()[b] for b in range(256)] + [a + b for a, b in BYTE_MERGES] + list(SPECIALS)
    types = [TOKEN_NORMAL] * (len(tokens) - len(SPECIALS)) + [TOKEN_CONTROL] * len(SPECIALS)
    return tokens, types


def token_id(token: str) -> int:
    return vocabulary()[0].index(token)


VOCAB_SIZE = len(vocabulary()[0])


def llama_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of each head from [half 0 | half 1] to interleaved pairs (llama.cpp's layout)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path: str, arch: str, config, state_dict: dict[str, torch.Tensor], name: str | None = None,
               qtype=None) -> None:
    """``state_dict`` (HF names, float32) as a GGUF file of architecture ``arch`` (``llama`` or ``qwen2``);
    with ``qtype`` (a ``gguf.GGMLQuantizationType``) its matrices are stored in that format (norms and
    biases stay float32, as llama.cpp's quantizer leaves them)."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    if name is not None:
        writer.add_name(name)
    _add_hparams(writer, config)
    _add_tokenizer(writer)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for hf_name, tensor in sorted(state_dict.items()):
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = _llama_layout(arch, hf_name, tensor, config).numpy().astype(np.float32)
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if qtype is not None and data.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama_layout(arch: str, hf_name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    if arch != "llama":
        return tensor
    if ".q_proj." in hf_name:
        return llama_permute(tensor, config.num_attention_heads)
    if ".k_proj." in hf_name:
        return llama_permute(tensor, config.num_key_value_heads)
    return tensor


def _add_hparams(writer, config) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


def rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}  # transformers 5; 4.x has rope_theta
    return parameters.get("rope_theta") or config.rope_theta


def _add_tokenizer(writer) -> None:
    tokens, types = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{a} {b}" for a, b in BYTE_MERGES])
    writer.add_bos_token_id(token_id("<|im_start|>"))
    writer.add_eos_token_id(token_id("<|im_end|>"))
    writer.add_pad_token_id(token_id("<|endoftext|>"))
    writer.add_chat_template(CHAT_TEMPLATE)
