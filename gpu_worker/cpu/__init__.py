"""The worker's CPU path: what only a CPU worker runs or chooses.

- worker_setup: the dtype behind `dtype: auto` and the torch thread count;
- packed_linear: linear weights packed for oneDNN or the C kernels, and the products with them;
- fused_ops: a layer's element-wise passes (RMSNorm, RoPE, SiLU·mul) as C calls;
- c_layers: every decoder layer of a step in one C call.

The C kernels themselves and their ctypes wrappers are in kernels/native/.
"""
