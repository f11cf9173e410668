"""Triton kernels (CUDA tensors; CPU tensors under TRITON_INTERPRET=1)."""
