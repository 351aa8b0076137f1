"""GGUF files (llama.cpp's format) as a model source: metadata, tensors and vocabulary."""
