"""hetero-infer: shared pieces of the services (config, errors, logging, CLI, in-process engine)."""

__version__ = "0.1.0"
