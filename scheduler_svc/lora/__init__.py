"""Which LoRA adapter each worker slot holds: the registry of adapters by name, the manager that
loads and unloads them on every replica (the same slot everywhere), and a replica's view of them.
"""
