"""The named (pp, dp, tp) device mesh of a ParallelConfig.

Creating a mesh creates one process group per axis slice, which costs a round of store
traffic on every rank (slow on gloo). Meshes are therefore cached per (device type, shape)
for as long as the default process group lives, so a campaign that measures many configs in
one set of processes pays for each shape once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from paratune.parallel import MeshAxis, ParallelConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MESH_AXES", "build_mesh", "clear_mesh_cache", "closing_process_group"]

MESH_AXES: tuple[str, ...] = tuple(axis.value for axis in MeshAxis)
"""Mesh axis names, outermost first: ``("pp", "dp", "tp")``."""

_CACHE: dict[tuple[int, str, tuple[int, ...]], DeviceMesh] = {}


def build_mesh(config: ParallelConfig, device_type: str) -> DeviceMesh:
    """The 3-D device mesh for ``config`` over the initialised default process group.

    Args:
        config: The layout; its :meth:`~paratune.ParallelConfig.mesh_shape` gives the degrees.
        device_type: ``"cpu"`` or ``"cuda"``.

    Returns:
        A mesh with axes named by :class:`~paratune.MeshAxis` (``pp``, ``dp``, ``tp``), reused
        from the cache when one of the same shape was built in this process group.

    Raises:
        RuntimeError: no default process group is initialised.
        paratune.ConfigError: the config's world size differs from the process group's.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialised default process group")
    config.validate(world_size=dist.get_world_size())
    shape = tuple(config.mesh_shape())
    key = (id(dist.group.WORLD), device_type, shape)
    mesh = _CACHE.get(key)
    if mesh is None:
        stale = [k for k in _CACHE if k[0] != key[0]]
        for k in stale:  # meshes of a destroyed process group
            del _CACHE[k]
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
        _CACHE[key] = mesh
    return mesh


def clear_mesh_cache() -> None:
    """Forget cached meshes (call before destroying the process group)."""
    _CACHE.clear()


@contextmanager
def closing_process_group() -> Iterator[None]:
    """Run the body, then forget the cached meshes and destroy the default process group.

    When the body finishes, every rank first meets at a barrier: a rank that closes its gloo
    connections while a peer is still reading aborts that peer at exit. When the body raises,
    the group is destroyed at once, since a peer may never reach a barrier.

        with closing_process_group():
            ...  # collectives
    """
    import torch.distributed as dist

    try:
        yield
    except BaseException:
        clear_mesh_cache()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    clear_mesh_cache()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
