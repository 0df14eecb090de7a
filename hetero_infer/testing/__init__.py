"""Helpers that the tests and the benchmarks share: starting the stack as real processes,
common requests against it, and tiny random checkpoints. Not used by the services themselves."""
