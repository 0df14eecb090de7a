"""The model a worker runs and its weights: the decoder (`model`), how it is built for a device and
dtype (`model_build`), checkpoints from Hugging Face directories and GGUF files (`checkpoint`,
`fp8_checkpoint`), which quantized forms are served (`weight_quantization`), and the draft model of
speculative decoding. A new model family goes here. (A GGUF tensor kept in its blocks is
`gpu_worker/gguf_blocks.py`: the CPU path reads it too, and the model builds on the CPU path.)
"""
