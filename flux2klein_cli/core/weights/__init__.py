"""Checkpoint reading: safetensors (and later Orbax) straight into NNX modules."""
