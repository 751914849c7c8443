"""Ahead-of-time compilation: program specs from configs, an on-disk store of serialized
executables, and TPU targets compiled from any host through libtpu's topology description."""
