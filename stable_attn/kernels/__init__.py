"""Attention kernels: the Triton FlashAttention-2 kernels and their PyTorch reference.

``reference`` is the CPU path and the readable spec; ``triton_attention`` (imported lazily, Linux
with Triton only) is the fast path. Both follow docs/ALGORITHM.md with the constants in ``stable_attn.rules``.
"""
