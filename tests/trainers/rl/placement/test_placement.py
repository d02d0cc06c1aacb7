"""plan_placement against OpenRLHF 0.10.2's placement rules (train_ppo_ray.py, RayActorGroup,
create_vllm_engines), every colocation mode checked by hand."""
import subprocess
import sys

import pytest

from posttrain.config.placement_plan import Placement, PlacementError, RoleSpec, plan_placement


def plan(**kw):
    base = dict(actor=(1, 2), ref=None, critic=None, reward=None, num_engines=0)
    return plan_placement(**{**base, **kw})


def test_no_colocation_own_groups_or_plain_actors():
    p = plan(actor=(1, 2), ref=(1, 2), critic=(1, 1), reward=(2, 1), num_engines=2)
    assert p.roles["actor"] == RoleSpec("actor", 2, "actor", (0, 1), 1.0)
    assert p.roles["ref"] == RoleSpec("ref", 2, "ref", (0, 1), 1.0)
    # one GPU per node: RayActorGroup starts plain 1-GPU actors, no placement group
    assert p.roles["critic"] == RoleSpec("critic", 1, "", (), 1.0)
    assert p.roles["reward"] == RoleSpec("reward", 2, "", (), 1.0)
    # engines always get their own PACK group outside colocate_all
    assert p.roles["engine"] == RoleSpec("engine", 2, "engines", (0, 1), 1.0, 1)
    assert p.groups == {"actor": 2, "ref": 2, "engines": 2}
    assert p.world == 2 + 2 + 1 + 2 + 2


def test_colocate_actor_ref():
    p = plan(actor=(1, 2), ref=(1, 2), num_engines=2, colocate_actor_ref=True)
    assert p.roles["actor"] == RoleSpec("actor", 2, "actor_ref", (0, 1), 0.2)
    assert p.roles["ref"] == RoleSpec("ref", 2, "actor_ref", (0, 1), 0.2)
    assert p.roles["engine"] == RoleSpec("engine", 2, "engines", (0, 1), 1.0)
    assert p.groups == {"actor_ref": 2, "engines": 2}
    assert p.world == 4


def test_colocate_actor_ref_without_ref_still_groups_actor():
    # OpenRLHF creates the actor-sized group whenever the flag is set; the actor asks 0.2 of each bundle
    p = plan(actor=(2, 1), colocate_actor_ref=True)
    assert p.roles["actor"] == RoleSpec("actor", 2, "actor_ref", (0, 1), 0.2)
    assert set(p.roles) == {"actor"}
    assert p.groups == {"actor_ref": 2}
    assert p.world == 2


def test_colocate_critic_reward():
    p = plan(actor=(1, 1), critic=(1, 2), reward=(1, 2), colocate_critic_reward=True)
    assert p.roles["actor"] == RoleSpec("actor", 1, "", (), 1.0)
    assert p.roles["critic"] == RoleSpec("critic", 2, "critic_reward", (0, 1), 0.2)
    assert p.roles["reward"] == RoleSpec("reward", 2, "critic_reward", (0, 1), 0.2)
    assert p.groups == {"critic_reward": 2}
    assert p.world == 3


def test_colocate_critic_reward_one_side_missing():
    # no reward model: the critic still gets the critic-sized group at 0.2
    p = plan(critic=(1, 2), colocate_critic_reward=True)
    assert p.roles["critic"] == RoleSpec("critic", 2, "critic_reward", (0, 1), 0.2)
    assert p.groups == {"actor": 2, "critic_reward": 2}
    # no critic: the flag does nothing, the reward model is placed on its own
    p = plan(reward=(1, 2), colocate_critic_reward=True)
    assert p.roles["reward"] == RoleSpec("reward", 2, "reward", (0, 1), 1.0)
    assert p.groups == {"actor": 2, "reward": 2}


def test_colocate_both_pairs_with_tp_engines():
    p = plan(
        actor=(1, 4), ref=(1, 4), critic=(1, 2), reward=(1, 2), num_engines=2, engine_tp=2,
        colocate_actor_ref=True, colocate_critic_reward=True,
    )
    assert p.roles["actor"].group == p.roles["ref"].group == "actor_ref"
    assert p.roles["ref"].bundles == (0, 1, 2, 3) and p.roles["ref"].share == 0.2
    assert p.roles["critic"] == RoleSpec("critic", 2, "critic_reward", (0, 1), 0.2)
    assert p.roles["reward"] == RoleSpec("reward", 2, "critic_reward", (0, 1), 0.2)
    # engine i starts at bundle i * tp and spans tp bundles
    assert p.roles["engine"] == RoleSpec("engine", 2, "engines", (0, 2), 1.0, 2)
    assert p.groups == {"actor_ref": 4, "engines": 4, "critic_reward": 2}
    assert p.world == 10


def test_colocate_all_everything_in_one_group():
    four = (1, 4)
    p = plan(actor=four, ref=four, critic=four, reward=four, num_engines=4, colocate_all=True)
    for name in ("actor", "ref", "critic", "reward"):
        assert p.roles[name] == RoleSpec(name, 4, "all", (0, 1, 2, 3), 0.2)
    assert p.roles["engine"] == RoleSpec("engine", 4, "all", (0, 1, 2, 3), 0.2, 1)
    assert p.groups == {"all": 4}
    assert p.world == 4


def test_colocate_all_tp_engines_and_smaller_critic():
    p = plan(actor=(2, 2), critic=(1, 2), num_engines=2, engine_tp=2, colocate_all=True)
    assert p.roles["engine"] == RoleSpec("engine", 2, "all", (0, 2), 0.2, 2)
    assert p.roles["critic"] == RoleSpec("critic", 2, "all", (0, 1), 0.2)
    assert p.groups == {"all": 4} and p.world == 4


def test_colocate_all_async_engines_get_own_group():
    p = plan(actor=(1, 2), ref=(1, 2), num_engines=1, colocate_all=True, async_enable=True)
    assert p.roles["ref"] == RoleSpec("ref", 2, "all", (0, 1), 0.2)
    assert p.roles["engine"] == RoleSpec("engine", 1, "engines", (0,), 1.0)
    assert p.groups == {"all": 2, "engines": 1}
    assert p.world == 3


def test_colocate_all_with_critic_reward_flag_gets_new_group():
    p = plan(
        actor=(1, 2), critic=(1, 2), reward=(1, 2), num_engines=2,
        colocate_all=True, colocate_critic_reward=True,
    )
    assert p.roles["actor"].group == p.roles["engine"].group == "all"
    assert p.roles["critic"].group == p.roles["reward"].group == "critic_reward"
    assert p.groups == {"all": 2, "critic_reward": 2}
    assert p.world == 4


def test_actor_ref_mismatch():
    with pytest.raises(PlacementError) as e:
        plan(actor=(1, 1), ref=(2, 1), colocate_actor_ref=True)
    assert str(e.value) == (
        "--train.colocate_actor_ref needs --ref.num_nodes/--ref.num_gpus_per_node equal to the actor's "
        "(2 x 1 vs 1 x 1)"
    )
    # same rank count, different shape: OpenRLHF compares nodes and GPUs per node separately
    with pytest.raises(PlacementError, match="--train.colocate_all needs --ref"):
        plan(actor=(1, 2), ref=(2, 1), colocate_all=True)


def test_critic_reward_mismatch():
    with pytest.raises(PlacementError, match=r"colocate_critic_reward .*\(1 x 4 vs 1 x 2\)"):
        plan(critic=(1, 2), reward=(1, 4), colocate_critic_reward=True)


def test_colocate_all_engine_mismatch():
    with pytest.raises(PlacementError, match=r"--vllm.num_engines x --vllm.tensor_parallel_size \(4 vs 2\)"):
        plan(actor=(1, 4), num_engines=1, engine_tp=2, colocate_all=True)
    plan(actor=(1, 4), num_engines=1, engine_tp=2, colocate_all=True, async_enable=True)  # async: fine


def test_colocate_all_role_larger_than_group():
    with pytest.raises(PlacementError, match=r"critic.*\(1 x 4\).*\(1 x 2\)"):
        plan(actor=(1, 2), critic=(1, 4), colocate_all=True)


def test_absent_roles():
    p = plan(actor=(1, 8))
    assert set(p.roles) == {"actor"}
    assert p.groups == {"actor": 8} and p.world == 8
    p = plan(actor=(1, 1), reward=(1, 1), num_engines=0)
    assert set(p.roles) == {"actor", "reward"} and p.groups == {} and p.world == 2


def test_table():
    p = plan(actor=(1, 2), ref=(1, 2), num_engines=1, engine_tp=2, colocate_all=True, async_enable=True)
    assert p.table() == [
        ("actor", "group all bundles 0-1, 0.2 of each"),
        ("ref", "group all bundles 0-1, 0.2 of each"),
        ("engine", "group engines bundles 0-1, 1 of each (2 per engine)"),
    ]
    p = plan(actor=(1, 2), critic=(3, 1), num_engines=1, colocate_actor_ref=True)
    assert p.table() == [
        ("actor", "group actor_ref bundles 0-1, 0.2 of each"),
        ("engine", "group engines bundle 0, 1 of each"),
        ("critic", "no placement group, 3 x 1 GPU"),
    ]
    assert isinstance(p, Placement) and p.world == 2 + 1 + 3


def test_module_imports_neither_ray_nor_torch():
    code = (
        "import sys, posttrain.config.placement_plan; "
        "assert not {'ray', 'torch'} & set(sys.modules), sorted({'ray', 'torch'} & set(sys.modules))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_teacher_is_placed_as_the_reference_is():
    """On-policy distillation's teacher (not in OpenRLHF): a group of its own, or the actor's bundles when
    the reference shares them; six roles on one bundle take a sixth of it each."""
    p = plan(ref=(1, 2), teacher=(1, 2))
    assert p.roles["teacher"] == RoleSpec("teacher", 2, "teacher", (0, 1), 1.0)
    assert p.groups == {"actor": 2, "ref": 2, "teacher": 2}
    p = plan(ref=(1, 2), teacher=(1, 1), colocate_actor_ref=True)
    assert p.roles["teacher"] == RoleSpec("teacher", 1, "actor_ref", (0,), 0.2)
    assert p.roles["actor"].share == p.roles["ref"].share == 0.2
    p = plan(ref=(1, 2), critic=(1, 2), reward=(1, 2), teacher=(1, 2), num_engines=2, colocate_all=True)
    assert {name: spec.share for name, spec in p.roles.items()} == {
        name: 1 / 6 for name in ("actor", "ref", "teacher", "engine", "critic", "reward")}
    assert plan(teacher=None).roles.keys() == {"actor"}
