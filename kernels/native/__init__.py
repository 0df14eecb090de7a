"""The CPU's C kernels: their sources (*.c, *.h, shipped as package data and compiled on first use)
and the Python wrappers that load and call them with ctypes.

`lib` builds and loads the one shared library; `decode_attention`, `prompt_attention`, `linear` and
`argmax` wrap its kernels for kernels/torch_attention.py and gpu_worker/cpu/. Nothing is imported
here: importing a submodule runs this file first, so a re-export here would be a cycle through it.
"""
