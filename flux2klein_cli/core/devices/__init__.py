"""What the programs run on: the mesh and its sharding rules, multi-process runs, TPU presets
and topologies, and the process-wide JAX settings."""
