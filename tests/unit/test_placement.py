"""Placement section: defaults, validation messages, device resolution, memory by hand, fit checks."""
import pytest

from dstrain.config import ConfigError
from dstrain.rl.placement import (ROLES, PlacementConfig, check_fits, format_placement_plan, placement_from_dict,
                                  placement_memory, resolve_devices, validate_placement)

G = 10 ** 9
COUNTS = {"policy": 1 * G, "guidance": G // 2, "reference": 1 * G, "critic": G // 2, "critic_target": G // 2,
          "value": G // 2}


def test_defaults():
    p = placement_from_dict({})
    assert p.reference.device == "cpu" and not p.reference.engine
    assert p.critic_target.device == "cpu" and not p.critic_target.engine
    for role in ("policy", "guidance", "critic", "value"):
        assert p.role(role).device == "auto" and p.role(role).engine and p.role(role).profile == "auto"
    assert [r for r in ROLES if p.trainable(r)] == ["policy", "guidance", "critic", "value"]
    assert p.kind("reference") == "module (frozen)" and p.kind("policy") == "engine auto (trained)"


def test_role_defaults_survive_partial_sections():
    p = placement_from_dict({"reference": {"device": "cuda:0"}, "guidance": {"frozen": True, "engine": False},
                             "policy": {"profile": "zero2"}})
    assert p.reference.device == "cuda:0" and p.reference.engine is False  # still a plain module
    assert not p.trainable("guidance") and p.kind("guidance") == "module (frozen)"
    assert p.kind("policy") == "engine zero2 (trained)"
    p = placement_from_dict({"reference": {"engine": True, "profile": "zero3"}})
    assert p.kind("reference") == "engine zero3 (frozen)"


@pytest.mark.parametrize("section, key, fragment", [
    ({"critic": {"device": "gpu0"}}, "placement.critic.device", "cuda:N"),
    ({"critic": {"device": "cuda:x"}}, "placement.critic.device", "cuda:N"),
    ({"policy": {"devcie": "cpu"}}, "placement.policy.devcie", "did you mean 'device'"),
    ({"actor": {}}, "placement.actor", "unknown key"),
    ({"reference": {"engine": True, "optimizer": True}}, "placement.reference.optimizer", "never trained"),
    ({"guidance": {"frozen": True, "optimizer": True}}, "placement.guidance.optimizer", "is frozen"),
    ({"critic_target": {"engine": True, "profile": "zero2"}}, "placement.critic_target.profile", "zero0, zero3"),
    ({"critic_target": {"profile": "zero3"}}, "placement.critic_target.profile", "engine: true"),
    ({"policy": {"engine": False}}, "placement.policy.engine", "needs a DeepSpeed engine"),
    ({"guidance": {"engine": False}}, "placement.guidance.engine", "frozen: true"),
    ({"value": {"optimizer": False}}, "placement.value.optimizer", "always trained"),
    ({"policy": {"profile": "zero9"}}, "placement.policy.profile", "unknown profile"),
    ({"policy": {"engine": "yes"}}, "placement.policy.engine", "true or false"),
])
def test_validation_names_role_and_key(section, key, fragment):
    with pytest.raises(ConfigError) as err:
        placement_from_dict(section, source="r.json")
    msg = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in msg
    assert msg.startswith(f"r.json: {key}:"), msg
    assert fragment in msg, msg


def test_cuda_index_checked_against_count():
    p = placement_from_dict({"value": {"device": "cuda:2"}})
    validate_placement(p, cuda_count=3)
    with pytest.raises(ValueError, match=r"placement\.value\.device: cuda:2 but this machine has 2 GPU"):
        validate_placement(p, cuda_count=2)
    with pytest.raises(ValueError, match=r"placement\.value\.device"):
        resolve_devices(p, 2)


def test_resolve_devices():
    p = placement_from_dict({"critic": {"device": "cuda"}, "value": {"device": "cuda:1"}})
    on_gpu = resolve_devices(p, 2)
    assert [on_gpu.role(r).device for r in ROLES] == ["cuda:0", "cuda:0", "cpu", "cuda:0", "cpu", "cuda:1"]
    assert p.policy.device == "auto"  # the input is not modified
    on_cpu = resolve_devices(p, 0)
    assert {on_cpu.role(r).device for r in ROLES} == {"cpu"}
    assert on_cpu.critic.engine and not on_cpu.reference.engine  # only devices change


def test_memory_by_hand_single_gpu():
    p = resolve_devices(PlacementConfig(), 1)
    mem = placement_memory(p, COUNTS, "bf16", world_size=1)
    # engines at profile auto count as zero0: 16 bytes/param in 16-bit
    #   policy 16 x 1e9 + guidance 16 x 0.5e9 + critic 16 x 0.5e9 + value 16 x 0.5e9 = 40e9 on cuda:0
    # plain frozen modules at 2 bytes/param on cpu: reference 2e9 + critic_target 1e9 = 3e9
    assert mem == {"cuda:0": 40 * G, "cpu": 3 * G}
    mem32 = placement_memory(p, COUNTS, "fp32", world_size=1)
    # fp32 engines: (4 + 4 + 12) = 20 bytes/param -> 50e9; frozen modules 4 bytes/param -> 6e9
    assert mem32 == {"cuda:0": 50 * G, "cpu": 6 * G}


def test_memory_by_hand_profiles_and_ranks():
    p = resolve_devices(placement_from_dict({
        "policy": {"profile": "zero2"},
        "critic": {"profile": "zero3_offload"},
        "reference": {"engine": True, "profile": "zero3", "device": "cuda:0"},
        "guidance": {"frozen": True, "engine": False},
    }), 2)
    largest = {"critic": 10 ** 7, "reference": 10 ** 8}
    mem = placement_memory(p, COUNTS, "bf16", world_size=2, largest_module=largest)
    # per GPU (N = 2 ranks, one node):
    #   policy zero2: 2P + 14P/2 = 9 x 1e9                      = 9.0e9
    #   guidance frozen module: 2 x 0.5e9                        = 1.0e9
    #   reference frozen zero3: 2P/2 + 2L = 1e9 + 2e8            = 1.2e9
    #   critic zero3_offload: 4L = 4e7 on the GPU                = 0.04e9
    #   value auto = zero0: 16 x 0.5e9                           = 8.0e9
    # cpu per node: critic offload 16P x 1 = 8e9; critic_target 2 x 0.5e9 x 2 local ranks = 2e9
    assert mem == {"cuda:0": 9 * G + G + 12 * 10 ** 8 + 4 * 10 ** 7 + 8 * G, "cpu": 8 * G + 2 * G}


def test_memory_on_cpu_only_machine_counts_every_local_rank():
    p = resolve_devices(PlacementConfig(), 0)
    counts = {r: 1000 for r in ROLES}
    # engines zero0 fp32: 20 B/param x 4 roles; frozen modules 4 B/param x 2; x 2 local ranks
    assert placement_memory(p, counts, "fp32", world_size=2) == {"cpu": 2 * (20 * 4000 + 4 * 2000)}


def test_memory_input_errors():
    with pytest.raises(ValueError, match="resolve_devices"):
        placement_memory(PlacementConfig(), COUNTS, "bf16")
    p = resolve_devices(PlacementConfig(), 1)
    with pytest.raises(ValueError, match="lacks role.*value"):
        placement_memory(p, {k: v for k, v in COUNTS.items() if k != "value"}, "bf16")
    with pytest.raises(ValueError, match="precision"):
        placement_memory(p, COUNTS, "auto")
    assert placement_memory(p, {**COUNTS, "guidance": 0}, "bf16")["cuda:0"] == 32 * G  # an absent model


def test_check_fits():
    mem = {"cuda:0": 40 * G, "cpu": 3 * G}
    check_fits(mem, {"cuda": "80GB", "cpu": 16 * G})
    with pytest.raises(ValueError) as err:
        check_fits(mem, {"cuda:0": "24GB", "cpu": "16GB"})
    msg = str(err.value)
    assert "cuda:0 needs 40.0 GB" in msg and "capacity of 24.0 GB" in msg and "cpu" not in msg
    with pytest.raises(ValueError, match=r"cuda:0 needs 40\.0 GB .* capacity of 0\.45 x 80\.0 GB"):
        check_fits(mem, {"cuda": "80GB", "cpu": "16GB"}, margin=0.45)
    with pytest.raises(ValueError, match="cpu: no capacity given"):
        check_fits(mem, {"cuda": "80GB"})


def test_plan_table():
    p = resolve_devices(PlacementConfig(), 1)
    text = format_placement_plan(p, COUNTS, "bf16", capacities={"cuda": "24GB", "cpu": "64GB"})
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("role"))
    rows = {line.split()[0]: line for line in lines[header + 1:header + 7]}
    assert set(rows) == set(ROLES)
    assert "cpu" in rows["reference"] and "module (frozen)" in rows["reference"] and "2.0 GB" in rows["reference"]
    assert "cuda:0" in rows["policy"] and "engine auto (trained)" in rows["policy"] and "16.0 GB" in rows["policy"]
    assert "1,000,000,000" in rows["policy"]
    assert "cuda:0: 40.0 GB of 24.0 GB (DOES NOT FIT)" in text
    assert "cpu: 3.0 GB of 64.0 GB (fits)" in text
