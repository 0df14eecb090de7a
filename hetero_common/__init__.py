"""The base every service imports: configuration, typed errors, sampling parameters, logging
set-up, gRPC server helpers and model-file lookup. It imports no service and no product module."""

__version__ = "0.1.0"
