"""The placement: which ranks hold which role, and the groups it hands them."""

from __future__ import annotations

import pytest

from hybrid_engine.config import RunConfig
from hybrid_engine.config.sections import RolloutConfig
from hybrid_engine.parallel.placement import ROLES, Placement
from hybrid_engine.policy.placements import PLACEMENTS
from hybrid_engine.policy.placements import rank_map as _rank_map
from hybrid_engine.testing import run_ranks


def _cfg(**rollout) -> RunConfig:
    return RunConfig(rollout=RolloutConfig(**rollout))


def rank_map(kind: str, cfg: RunConfig, world: int) -> dict:
    from hybrid_engine.config import apply_overrides

    return _rank_map(apply_overrides(cfg, {"placement": kind}), world)


def test_colocated_puts_every_role_on_every_rank() -> None:
    assert rank_map("colocated", _cfg(), 3) == dict.fromkeys(ROLES, (0, 1, 2))


def test_separate_puts_the_trainer_roles_first_and_the_rollout_after() -> None:
    ranks = rank_map("separate", _cfg(num_ranks=1), 3)
    assert ranks == {"actor": (0, 1), "reference": (0, 1), "critic": (0, 1), "rollout": (2,),
                     "reward_model": (0, 1, 2)}
    # num_ranks=0: half the world, in multiples of the rollout's TP
    assert rank_map("separate", _cfg(tensor_parallel_size=2), 6)["rollout"] == (4, 5)


def test_bad_kinds_and_worlds_are_refused() -> None:
    with pytest.raises(ValueError, match=r"placement: unknown placement 'nowhere'.* colocated"):
        rank_map("nowhere", _cfg(), 2)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        rank_map("separate", _cfg(), 1)


def test_a_placement_is_one_module_and_one_registry_line() -> None:
    """Each registered placement's rank map lives in its policy's module."""
    assert PLACEMENTS.names() == ["colocated", "grouped", "separate"]
    for name in PLACEMENTS.names():
        kind = PLACEMENTS.get(name)
        assert kind.rank_map.__module__ == kind.policy.__module__, name


def _groups(kind: str) -> dict:
    import torch.distributed as dist

    p = Placement.build(kind, PLACEMENTS.get(kind).rank_map, _cfg(num_ranks=1),
                        dist.get_world_size(), dist.get_rank())
    out = {"describe": p.describe()}
    for role in ROLES:
        group = p.group(role)
        out[role] = {"holds": p.holds(role),
                     "group": None if group is None else dist.get_process_group_ranks(group)}
        if p.holds(role):
            mesh = p.mesh(role)
            out[role]["mesh"] = mesh.mesh.tolist()
            # a collective over the role's group reaches exactly its ranks
            t = mesh.mesh.new_ones(()).float()
            dist.all_reduce(t, group=mesh.get_group())
            out[role]["sum"] = float(t)
        else:
            with pytest.raises(ValueError) as e:
                p.mesh(role)
            out[role]["error"] = str(e.value)
    return out


def _both() -> dict:
    return {"separate": _groups("separate"), "colocated": _groups("colocated")}


def test_each_role_gets_the_group_and_mesh_of_its_ranks() -> None:
    out = run_ranks(_both, 3, timeout=60)
    for rank, r in enumerate(out):
        sep, col = r["separate"], r["colocated"]
        assert sep["describe"] == ("actor+reference+critic on ranks 0-1; rollout on ranks 2; "
                                   "reward_model on ranks 0-2")
        for role in ("actor", "reference", "critic"):
            assert sep[role]["holds"] == (rank < 2)
            assert sep[role]["group"] == [0, 1]
            if rank < 2:
                assert sep[role]["mesh"] == [0, 1] and sep[role]["sum"] == 2.0
            else:
                assert sep[role]["error"] == (f"rank 2 holds no {role} under "
                                              "placement='separate' (its ranks: [0, 1])")
        assert sep["rollout"]["group"] == [2] and sep["rollout"]["holds"] == (rank == 2)
        assert sep["reward_model"]["group"] is None and sep["reward_model"]["sum"] == 3.0
        if rank < 2:
            assert sep["rollout"]["error"] == (f"rank {rank} holds no rollout under "
                                               "placement='separate' (its ranks: [2])")
        for role in ROLES:  # colocated: the default group, a mesh over the world
            assert col[role] == {"holds": True, "group": None, "mesh": [0, 1, 2], "sum": 3.0}
        assert col["describe"] == "actor+rollout+reference+critic+reward_model on ranks 0-2"


def test_a_grouped_map_gives_each_role_its_ranks_in_ascending_order() -> None:
    """The order a map lists ranks in does not matter (a group's ranks, vLLM's TP
    grid and the sync's shards follow ascending ranks); a role the run does not
    build gets none."""
    from hybrid_engine.config import apply_overrides

    cfg = apply_overrides(RunConfig(), {
        "placement": "grouped", "algorithm.advantage": "gae",
        "placement_map": "critic:3;actor,rollout:2,0-1"})
    assert rank_map("grouped", cfg, 4) == {"actor": (0, 1, 2), "rollout": (0, 1, 2),
                                           "reference": (), "critic": (3,), "reward_model": ()}
    twice = apply_overrides(cfg, {"placement_map": "critic:3;actor,rollout:0-2,1"})
    with pytest.raises(ValueError, match=r"placement_map: '0-2,1' names a rank twice"):
        rank_map("grouped", twice, 4)
