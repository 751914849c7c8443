"""Where a model comes from: resolving `--model`, the registry of known models, composed
components, a snapshot on disk, and the writers of the test fixtures."""
