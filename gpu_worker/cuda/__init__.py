"""What only a CUDA worker does: warm-up, memory headroom and the KV pool (`cuda_setup`), CUDA
graphs, a KV cache whose addresses outlive a suspend (`static_kv_memory`), and which device each
worker process of a host takes (`device_map`).
"""
