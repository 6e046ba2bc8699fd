"""The models ``bench.peer_llamacpp`` runs both servers on (``--model``): each one's GGUF file as its package
ships it, windserve's configs and how to count a chat prompt's tokens the way both servers do.

    model                   file (as shipped)   windserve disaggregated / aggregated         llama-server
    smollm2-135m-instruct   Q4_1                configs/smollm2.yaml / the same, AGGREGATED   the file's template
    gemma3-270m             Q4_K_M              configs/gemma3.yaml / gemma3_aggregated.yaml  windserve's, as a file

Gemma 3's file carries no chat template: windserve uses its built-in one (engine/chat_templates.py), and
llama-server is given the same Jinja text (``--chat-template-file``), so both render the same turns; the
table's prompt-tokens column shows they did. (Without it llama-server falls back to ChatML; and
``--chat-template gemma``, a built-in name in older llama.cpp, is read by today's Jinja-first server as a
template whose text is "gemma": 3-token prompts, as a first run of this bench found.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

# configs/smollm2.yaml's disagg-only fields unset: aggregated refuses them
AGGREGATED = {"mode": "aggregated", "transport": "local", "torch_threads": 2, "context_num_pages": None,
              "generation_num_pages": None, "context_eviction": None, "generation_eviction": None,
              "local_prefill_max_tokens": 0}


@dataclass(frozen=True)
class PeerModel:
    name: str  # windserve's model name (engine.model_registry)
    quant: str  # the file's type, as its package ships it
    config: str  # disaggregated
    aggregated_config: str  # aggregated: the same file with AGGREGATED's changes, or the twin config
    aggregated_overrides: dict | None
    builtin_template: bool  # the file has no chat template: llama-server gets windserve's built-in one

    def llama_server_args(self, directory: str) -> list[str]:
        """Flags for llama-server; a template file is written into ``directory`` when one is needed."""
        if not self.builtin_template:
            return []
        from engine.chat_templates import builtin_chat
        from engine.gguf_index import GGUFIndex

        architecture = GGUFIndex(self.gguf_path()).fields["general.architecture"]
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{self.name}.jinja")
        with open(path, "w", encoding="utf-8") as f:
            f.write(builtin_chat(architecture).template)
        return ["--jinja", "--chat-template-file", path]

    def gguf_path(self) -> str:
        from engine.model_registry import gguf_source

        return gguf_source(self.name)

    def token_counter(self) -> Callable[[str], int]:
        """Tokens of the chat prompt with ``text`` as the one user message, as windserve renders it."""
        from engine.model_registry import resolve_model_path
        from engine.tokenizer import Tokenizer

        tokenizer = Tokenizer(resolve_model_path(self.name))
        return lambda text: len(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


MODELS = {
    "smollm2-135m-instruct": PeerModel("smollm2-135m-instruct", "Q4_1", os.path.join("configs", "smollm2.yaml"),
                                       os.path.join("configs", "smollm2.yaml"), AGGREGATED, False),
    "gemma3-270m": PeerModel("gemma3-270m", "Q4_K_M", os.path.join("configs", "gemma3.yaml"),
                             os.path.join("configs", "gemma3_aggregated.yaml"), None, True),
}
