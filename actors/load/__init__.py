"""Loading weights: Hugging Face folders, GGUF files, quantized formats, the model cache, presets and the embedded test models."""
