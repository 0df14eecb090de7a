"""Benchmarks of the stack, the engine, the scheduler and the kernels (benchmarks/README.md lists them).

Run each from the repository root, as `python benchmarks/NAME.py` or `python -m benchmarks.NAME`; they
import one another as `benchmarks.NAME`. Not part of the installed package.
"""
