"""Aids for tests and benchmarks: small models to plan (`zoo`, and the random block
stacks of `compositions`) and a step's measured memory (`measure`: the live-storage
tracker, the profiler, CUDA's allocator)."""
