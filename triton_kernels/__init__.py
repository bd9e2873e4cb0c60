"""Triton kernels of eagle3_ops, installed as `eagle3_ops.triton_kernels` (never as a top-level
`triton_kernels`, which is another project's package). One op per module: `@triton.jit` kernels and a
plain launcher; eagle3_ops/_register.py registers the launchers for CUDA tensors."""
