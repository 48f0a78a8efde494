"""The layout of a job's ranks: pipeline stages × data-parallel replicas × shards × tensor-parallel
ranks, and the torch ``DeviceMesh`` built from it.

``ud.init(sharding="fsdp", dp_replicate=R, tp=T)`` (or their variables, ``unified-dist launch``
flags, or ``accelerate launch --parallelism_config_*``) describes a world of ``R * S * T`` ranks;
``S`` (``dp_shard``) is the rest of the world. The mesh has the dimensions ``("dp_replicate",
"dp_shard", "tp")`` in that order, so global rank ``r`` sits at ``(r // (S*T), r // T % S, r % T)``:
the ``T`` tensor-parallel peers of one data-parallel rank are consecutive ranks (on one machine
when ``T`` divides the ranks per machine), and the data-parallel rank is ``r // T``.

- HSDP: ``fully_shard`` on the 2-D ``("dp_replicate", "dp_shard")`` sub-mesh: parameters
  ``(Replicate(), Shard(0))``, gradients reduce-scattered inside a replica and all-reduced across.
  With ``R == 1`` the 1-D ``dp_shard`` mesh (plain FSDP2).
- Tensor parallel: ``parallelize_module`` on the ``tp`` sub-mesh (:mod:`unified_dist.parallel.tensor_parallel`).

Nothing here communicates except :meth:`Layout.build_mesh` (it creates the process groups of each
dimension: every rank must call it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from ..errors import LaunchError, UnifiedDistError

DIMS = ("dp_replicate", "dp_shard", "tp")
"""The mesh's dimension names, outermost first (``"pp"`` comes before them when ``pp > 1``)."""
PP_DIM = "pp"


@dataclass(frozen=True)
class Layout:
    """``pp × replicate × shard × tp`` ranks; see the module docstring for where each rank sits."""

    replicate: int = 1
    shard: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.replicate * self.shard * self.tp

    @property
    def data_parallel(self) -> int:
        """Ranks that see different data: ``replicate * shard``."""
        return self.replicate * self.shard

    def data_parallel_rank(self, rank: int) -> int:
        """The data-parallel index of global ``rank`` (its tensor-parallel peers and the ranks at its
        place in the other pipeline stages share it)."""
        return rank // self.tp % self.data_parallel

    def pp_rank(self, rank: int) -> int:
        """The pipeline stage global ``rank`` holds (0 without pipeline parallelism)."""
        return rank // (self.replicate * self.shard * self.tp)

    def tp_rank(self, rank: int) -> int:
        """The index of global ``rank`` among its tensor-parallel peers."""
        return rank % self.tp

    @classmethod
    def plan(cls, world: int, dp_replicate: Any = 1, tp: int = 1, dp_shard: Optional[int] = None,
             machines: Optional[Callable[[], int]] = None, pp: int = 1) -> "Layout":
        """The layout of ``world`` ranks for ``pp`` stages, ``dp_replicate`` (an integer, or ``"nodes"``:
        the number of machines, asked of ``machines()``) and ``tp``; ``dp_shard`` is what a launcher
        declared (``None``: the rest of the world). Raises a one-line :class:`LaunchError` with the fix
        when the sizes do not multiply to the world size."""
        if dp_replicate == "nodes":
            dp_replicate = machines() if machines is not None else 1
        pipe = f"pp={pp} x " if pp > 1 else ""
        if world % (pp * dp_replicate * tp):
            raise LaunchError(
                f"{pipe}dp_replicate={dp_replicate} x tp={tp} does not divide the world of {world} ranks; "
                f"choose sizes whose product divides {world} (dp_shard is the rest: "
                f"world / ({pipe}dp_replicate x tp))")
        shard = world // (pp * dp_replicate * tp)
        if dp_shard is not None and dp_shard != shard:
            raise LaunchError(
                f"dp_shard_size={dp_shard} x {pipe}dp_replicate={dp_replicate} x tp={tp} is not the world of "
                f"{world} ranks; give --parallelism_config_dp_shard_size {shard}")
        return cls(dp_replicate, shard, tp, pp)

    def build_mesh(self, device_type: str) -> Any:
        """The ``DeviceMesh`` of this layout on ``device_type`` (always given: torch's default follows
        the accelerator, which on a GPU host with a gloo job is wrong). A collective."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.pp > 1:
            return init_device_mesh(device_type, (self.pp, self.replicate, self.shard, self.tp),
                                    mesh_dim_names=(PP_DIM, *DIMS))
        return init_device_mesh(device_type, (self.replicate, self.shard, self.tp), mesh_dim_names=DIMS)

    def data_parallel_mesh(self, mesh: Any) -> Any:
        """The sub-mesh of ``mesh`` (built by :meth:`build_mesh`) that ``fully_shard`` shards over:
        2-D (replicate, shard) for HSDP, else 1-D."""
        return mesh["dp_replicate", "dp_shard"] if self.replicate > 1 else mesh["dp_shard"]


def accelerate_dp_shard(environ: Mapping[str, str]) -> Optional[int]:
    """The ``dp_shard`` size ``accelerate launch --use_parallelism_config`` declared (``None``
    without that flag). Context and sequence parallelism are refused: unified_dist has neither."""
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").strip().lower() != "true":
        return None
    for what in ("CP", "SP"):
        size = environ.get(f"PARALLELISM_CONFIG_{what}_SIZE", "1").strip() or "1"
        if size != "1":
            raise LaunchError(
                f"accelerate launch --parallelism_config_{what.lower()}_size {size}: unified_dist has no "
                f"{'context' if what == 'CP' else 'sequence'} parallelism; drop the flag (dp_replicate, dp_shard and "
                "tp are supported)")
    try:
        return int(environ.get("PARALLELISM_CONFIG_DP_SHARD_SIZE", "1"))
    except ValueError:
        raise LaunchError(f"PARALLELISM_CONFIG_DP_SHARD_SIZE={environ['PARALLELISM_CONFIG_DP_SHARD_SIZE']!r} "
                          "(accelerate launch --parallelism_config_dp_shard_size) is not an integer") from None


def machines(hosts: Sequence[str]) -> int:
    """The number of machines among ``hosts`` (each rank's host name, in rank order). Raises when
    they run different numbers of ranks: one replica per machine needs equal machines."""
    counts = {h: list(hosts).count(h) for h in hosts}
    if len(set(counts.values())) > 1:
        raise UnifiedDistError(
            f"dp_replicate='nodes' needs the same number of ranks on every machine, got {counts}; "
            "give dp_replicate as a number")
    return len(counts)


__all__ = ["DIMS", "PP_DIM", "Layout", "accelerate_dp_shard", "machines"]
