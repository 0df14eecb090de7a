"""hetero-infer, the product: CLI, supervisor, in-process engine, config sources, bench, protogen.

It sits on top of the services (`gateway`, `scheduler_svc`, `gpu_worker`, `kernels`) and the
shared base (`hetero_common`); nothing below imports from it."""

from hetero_common import __version__

__all__ = ["__version__"]
