"""paratune.profiler."""
