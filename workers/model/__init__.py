"""Model definitions, their configs, and loading weights (safetensors, GGUF, dummy) into a rank's
shards."""
