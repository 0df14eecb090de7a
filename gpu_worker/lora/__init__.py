"""LoRA adapters on the worker: an adapter's weights read and checked (`lora_adapter`), and the
slots that hold them on the device with each step's per-row products (`lora_slots`).
"""
