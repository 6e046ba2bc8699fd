"""GPU decode kernels (Triton, beside engine/native/'s CPU kernels) and their torch references.

Importing this package never needs Triton: the Triton modules load on the first call that runs them.
"""

from engine.gpu.paged_attention import default_num_splits, paged_decode_attention, write_kv

__all__ = ["default_num_splits", "paged_decode_attention", "write_kv"]
