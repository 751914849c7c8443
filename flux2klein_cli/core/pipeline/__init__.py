"""Text-to-image and editing on the NNX models: one code path, the denoise loop compiled whole."""
