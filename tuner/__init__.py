"""paratune.tuner."""
