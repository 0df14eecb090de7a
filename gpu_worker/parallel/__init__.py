"""Tensor parallelism: the sharded layers and their collectives (`tensor_parallel`), and how the
ranks of one replica find each other (`tp_rendezvous`).
"""
