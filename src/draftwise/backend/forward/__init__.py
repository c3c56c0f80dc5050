"""The engine's own forward: the CPU lean forward, the CUDA graphed forward, the library attention path."""
