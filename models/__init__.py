"""paratune.models."""
