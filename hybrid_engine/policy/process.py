"""The process a policy runs in: its default group, its watchdog, its groups' timeouts.

Job: the setup every policy does first and undoes last, in one place:

    proc = PolicyProcess(cfg.collective_timeout_s)   # joins (or makes) the world
    ... build the trainer, the engine, their groups ...
    proc.time_out_own_groups()                       # cfg's timeout on those groups
    ...
    proc.stop_watchdog()                             # a clean shutdown is not a silent rank
    engine.shutdown()
    proc.leave()                                     # destroys the group if it made it

What it does to a host process (`HybridActor`'s module docstring): uses the
default group if one exists, else makes one (one rank when not launched);
starts the watchdog unless a host runs its own; never sets a timeout on a
group the host made.
"""

from __future__ import annotations

import torch.distributed as dist

from hybrid_engine.parallel import watchdog
from hybrid_engine.parallel.dist import all_groups, init_distributed, set_collective_timeout

__all__ = ["PolicyProcess"]


class PolicyProcess:
    """This process's place in the job's world, as a policy holds it.

    Args:
        timeout_s: cfg.collective_timeout_s: the groups this process makes, and
            the watchdog's patience with a stopped or hung peer.

    Attributes:
        rank, world: this process's rank and the world size (default group).
        owns_group: this object made the default group (and destroys it in `leave`).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.owns_group = init_distributed(timeout_s, single_process=True)
        # A stopped or hung peer aborts the job after timeout_s (vLLM's own
        # all-reduces have no timeout); None on one rank or when a host runs its own.
        self._watchdog = None if watchdog.current() else watchdog.start(timeout_s)
        self._host_groups = [] if self.owns_group else all_groups()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def time_out_own_groups(self) -> None:
        """Sets timeout_s on every group made since (vLLM's, the FSDP mesh's, the
        policy's own); a host's groups keep their own."""
        set_collective_timeout(self.timeout_s,
                               [g for g in all_groups() if g not in self._host_groups])

    def stop_watchdog(self) -> None:
        """Stops the watchdog this object started (a clean shutdown is not a silent rank)."""
        if self._watchdog is not None:
            watchdog.stop()

    def leave(self) -> None:
        """Destroys the default group if this object made it (idempotent)."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
