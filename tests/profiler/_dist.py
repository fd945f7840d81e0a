"""One-process ``torch.distributed`` groups for tests that need a real process group."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def init_one_process_group(directory: Path, backend: str = "gloo") -> None:
    """Start a real one-process group on a file store in ``directory``."""
    import torch.distributed as dist

    store = dist.FileStore(str(directory / "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


@contextmanager
def one_process_group(directory: Path, backend: str = "gloo") -> Iterator[None]:
    """A one-process group for the body; afterwards the mesh cache is cleared and the group
    destroyed, also when the body raises."""
    import torch.distributed as dist

    from paratune.profiler.mesh import clear_mesh_cache

    init_one_process_group(directory, backend)
    try:
        yield
    finally:
        clear_mesh_cache()
        dist.destroy_process_group()
