"""paratune.datasets."""
