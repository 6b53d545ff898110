"""Tests for dstrain.engine.profiles: the DESIGN.md memory table and the profile choice.

GB below is 10**9 bytes. Budgets use the default margin 0.85, so an 80 GB GPU gives 68 GB.
Activations are given in fp32 and halve in bf16.
"""
import pytest

from dstrain.engine.profiles import (PROFILE_ORDER, Activations, Hardware, ModelStats, Plan, PlanError,
                                     choose_plan, choose_precision, format_bytes, format_plan, model_state_bytes,
                                     parse_bytes)

GB = 10**9
H100 = Hardware("cuda", 80 * GB, 1000 * GB, 8, True, True, "H100")
V100 = Hardware("cuda", 32 * GB, 512 * GB, 8, False, True, "V100")
CPU = Hardware("cpu", 8 * GB, 16 * GB, 2, False, False, "2-core CPU")


def stats(p, big, hidden=4096, layers=32):
    return ModelStats(params=int(p), largest_module_params=int(big), hidden_size=hidden, num_layers=layers)


# (id, P, L, N, hardware, micro_batch, fp32 activations per sample (plain, checkpointed), ckpt mode,
#  host override, expected profile, expected checkpointing)
CASES = [
    # 1.3B on 8 x 80 GB, bf16: zero0 = 16 x 1.3 = 20.8 GB + 4 x 2 GB = 28.8 GB <= 68 -> zero0
    ("1.3B-zero0", 1.3e9, 0.1e9, 8, H100, 4, (4 * GB, GB // 2), "auto", None, "zero0", False),
    # 7B on 8 x 80 GB: zero0 = 112 GB + 8 GB > 68; zero1 = 4 x 7 + 12 x 7 / 8 = 38.5 GB + 8 x 1 GB = 46.5 -> zero1
    ("7B-zero1", 7e9, 0.5e9, 8, H100, 8, (2 * GB, GB // 2), "auto", None, "zero1", False),
    # 7B, activations 14 GB/sample in bf16 x 4 = 56 GB: zero0 168, zero1 94.5, zero2 26.25 + 56 = 82.25,
    # zero3 16 x 7 / 8 + 4 x 0.5 = 16 + 56 = 72 > 68: nothing fits without checkpointing.
    # With checkpointing (1 GB x 4 = 4 GB): zero0 116 no, zero1 38.5 + 4 = 42.5 -> zero1 + checkpointing
    ("7B-ckpt", 7e9, 0.5e9, 8, H100, 4, (28 * GB, 2 * GB), "auto", None, "zero1", True),
    # same, checkpointing forced off: zero2_offload 4 x 7 = 28 + 56 = 84 no;
    # zero3_offload_optimizer 2 x 7 / 8 + 4 x 0.5 = 3.75 + 56 = 59.75 <= 68, host 14 x 7 = 98 GB <= 850
    ("7B-no-ckpt-forced", 7e9, 0.5e9, 8, H100, 4, (28 * GB, 2 * GB), False, None, "zero3_offload_optimizer", False),
    # 30B on 2 x 80 GB, acts 1 GB x 2 = 2 GB: zero0 480, zero1 120 + 180, zero2 60 + 210, zero3 240 + 4: none,
    # with or without checkpointing. zero2_offload 120 no; zero3_offload_optimizer 2 x 30 / 2 + 4 x 1 = 34 + 2
    # = 36 <= 68 (its gradient partition on the host), host 14 x 30 = 420 GB <= 850 -> offload without checkpointing
    ("30B-offload", 30e9, 1e9, 2, H100, 2, (2 * GB, GB), "auto", None, "zero3_offload_optimizer", False),
    # 30B, acts 20 GB x 2 = 40 GB (checkpointed 0.25 x 2 = 0.5 GB), host 500 GB (budget 425):
    # zero3_offload_optimizer 34 + 40 = 74 no; zero3_offload device 4 + 40 = 44 but host 16 x 30 = 480 > 425 no;
    # with checkpointing: zero2_offload 120.5 no, zero3_offload_optimizer 34 + 0.5 = 34.5, host 420 -> fits
    ("30B-offload-ckpt", 30e9, 1e9, 2, H100, 2, (40 * GB, GB // 2), "auto", 500 * GB,
     "zero3_offload_optimizer", True),
    # same with 1 TB host: zero3_offload (host 480 <= 850) comes before checkpointing in the offload pass
    ("30B-param-offload", 30e9, 1e9, 2, H100, 2, (40 * GB, GB // 2), "auto", None, "zero3_offload", False),
    # V100 (no fast bf16) -> fp16, same 2-byte terms: 1.3B zero0 20.8 + 4 x 1 = 24.8 <= 27.2 -> zero0
    ("V100-fp16", 1.3e9, 0.1e9, 8, V100, 4, (2 * GB, GB // 2), "auto", None, "zero0", False),
    # checkpointing forced on for a model that fits anyway
    ("forced-ckpt", 1.3e9, 0.1e9, 8, H100, 4, (4 * GB, GB // 2), True, None, "zero0", True),
    # CPU, fp32 (no fast bf16), 0.1B params on 2 ranks: zero0 20 x 0.1 = 2 GB + 0.2 GB <= 6.8 -> zero0
    ("cpu-small", 0.1e9, 0.01e9, 2, CPU, 1, (GB // 5, GB // 20), "auto", None, "zero0", False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_choose_plan_table(case):
    _, p, big, n, hw, micro, (plain, ckpt), mode, host, profile, want_ckpt = case
    if host is not None:
        hw = Hardware(hw.device_type, hw.device_memory, host, hw.ranks_per_node, hw.bf16_supported_fast,
                      hw.fp16_supported, hw.name)
    plan = choose_plan(stats(p, big), hw, Activations(plain, ckpt), n, micro, activation_checkpointing=mode)
    assert (plan.profile, plan.activation_checkpointing) == (profile, want_ckpt)
    assert plan.estimates[-1].fits and not any(e.fits for e in plan.estimates[:-1])
    assert plan.margin == 0.85


def test_plan_numbers_and_reason():
    plan = choose_plan(stats(7e9, 0.5e9), H100, Activations(2 * GB, GB // 2), 8, 8)
    assert plan.precision == "bf16" and "fast bf16" in plan.precision_reason
    zero0, zero1 = plan.estimates
    assert (zero0.model_states, zero0.activations, zero0.device_total) == (112 * GB, 8 * GB, 120 * GB)
    assert (zero1.model_states, zero1.device_total) == (38_500_000_000, 46_500_000_000)
    assert plan.reason == ("zero0 needs 120.0 GB > 68.0 GB budget; "
                           "zero1 fits: 38.5 GB model states + 8.0 GB activations.")
    text = format_plan(plan, stats(7e9, 0.5e9), H100, 8, 8)
    assert "P=7,000,000,000" in text and "N=8" in text and "M=80.0 GB" in text and "precision: bf16" in text
    chosen = [line for line in text.splitlines() if line.startswith("*")]
    assert len(chosen) == 1 and "zero1" in chosen[0]


def test_reason_explains_checkpointing_and_offload():
    ckpt = choose_plan(stats(7e9, 0.5e9), H100, Activations(28 * GB, 2 * GB), 8, 4)
    assert ckpt.reason == ("nothing fits without activation checkpointing (closest: zero3 needs 72.0 GB > 68.0 GB "
                           "budget); zero0 + checkpointing needs 116.0 GB > 68.0 GB budget; zero1 + checkpointing "
                           "fits: 38.5 GB model states + 4.0 GB activations.")
    assert "zero1 + checkpointing fits" in ckpt.reason
    off = choose_plan(stats(30e9, 1e9), H100, Activations(2 * GB, GB), 2, 2)
    assert "recomputation" in off.reason and "420.0 GB offloaded to host" in off.reason


def test_nothing_fits_raises_with_smallest_requirement():
    # 70B on one 24 GB GPU with 64 GB host: zero3_offload needs 4 GB on the device but 16 x 70 = 1120 GB host
    gpu = Hardware("cuda", 24 * GB, 64 * GB, 1, True, True, "RTX")
    with pytest.raises(PlanError) as err:
        choose_plan(stats(70e9, 1e9), gpu, Activations(GB, GB // 4), 1, 1)
    msg = str(err.value)
    assert "smallest per-rank need is zero3_offload + checkpointing with 4.1 GB against a budget of 20.4 GB" in msg
    assert "1.1 TB host per node against 54.4 GB" in msg
    # within the host budget only the non-offload profiles remain; with N=1 zero0 + ckpt (16 x 70 = 1120 GB
    # + 0.125 GB) beats zero3, which adds the gathered 4L
    assert "within the host budget the smallest is zero0 + checkpointing with 1.1 TB" in msg
    assert len(err.value.estimates) == 14  # 4 + 4 non-offload, 3 + 3 offload


def test_offload_does_not_help_on_cpu():
    # 1B params, fp32, 2 ranks of 8 GB (budget 6.8 GB), 16 GB RAM: zero0 20 GB, zero1 8 + 6, zero2 4 + 8,
    # zero3 10 + 8 x 0.05 = 10.4: none. zero3_offload_optimizer looks like 4 / 2 + 0.4 = 2.4 GB on the device,
    # but on a CPU the 16 GB of offloaded states and gradients (8 GB per rank) live in the same RAM:
    # 2.4 + 0.2 + 8 = 10.6 > 6.8.
    s, acts = stats(1e9, 0.05e9, hidden=2048, layers=16), Activations(GB // 5, GB // 20)
    with pytest.raises(PlanError) as err:
        choose_plan(s, CPU, acts, 2, 1)
    est = {(e.profile, e.activation_checkpointing): e for e in err.value.estimates}
    assert est[("zero3_offload_optimizer", False)].device_total == 10_600_000_000
    # the same numbers on a GPU of the same size, 20 GB of RAM: offload fits (2.6 GB device, 16 GB host <= 17)
    gpu = Hardware("cuda", 8 * GB, 20 * GB, 2, False, True)
    plan = choose_plan(s, gpu, acts, 2, 1, precision="fp32")
    assert (plan.profile, plan.activation_checkpointing) == ("zero3_offload_optimizer", False)
    assert plan.estimates[-1].device_total == 2_600_000_000


@pytest.mark.parametrize("profile,bf16,fp32", [
    # P = 1e9, L = 1e8, N = 4 (bytes, per rank)
    ("zero0", 16e9, 20e9),                              # 16P        | (4+4+12)P
    ("zero1", 4e9 + 3e9, 8e9 + 3e9),                    # 4P + 12P/N | 8P + 12P/N
    ("zero2", 2e9 + 3.5e9, 4e9 + 4e9),                  # 2P + 14P/N | 4P + 16P/N
    ("zero3", 4e9 + 0.4e9, 5e9 + 0.8e9),                # 16P/N + 4L | 20P/N + 8L
    ("zero2_offload", 4e9, 8e9),                        # 4P         | 8P
    ("zero3_offload_optimizer", 0.5e9 + 0.4e9, 1e9 + 0.8e9),  # 2P/N + 4L | 4P/N + 8L (gradients on the host)
    ("zero3_offload", 0.4e9, 0.8e9),                    # 4L         | 8L
])
def test_model_state_bytes_table(profile, bf16, fp32):
    s = stats(1e9, 1e8)
    assert model_state_bytes(profile, s, 4, "bf16", 8)[0] == int(bf16)
    assert model_state_bytes(profile, s, 4, "fp16", 8)[0] == int(bf16)
    assert model_state_bytes(profile, s, 4, "fp32", 8)[0] == int(fp32)


def test_host_bytes_per_node():
    s = stats(1e9, 1e8)
    assert model_state_bytes("zero0", s, 4, "bf16", 8)[1] == 0
    assert model_state_bytes("zero2_offload", s, 4, "bf16", 8)[1] == 12 * 10**9
    assert model_state_bytes("zero3_offload_optimizer", s, 4, "bf16", 8)[1] == 14 * 10**9  # + its 16-bit gradients
    assert model_state_bytes("zero3_offload", s, 4, "bf16", 8)[1] == 16 * 10**9
    assert model_state_bytes("zero3_offload", s, 4, "fp32", 8)[1] == 20 * 10**9
    # 16 ranks over 2 nodes of 8: each node holds half of the partitions
    assert model_state_bytes("zero3_offload_optimizer", s, 16, "bf16", 8)[1] == 7 * 10**9
    assert model_state_bytes("zero3_offload", s, 16, "bf16", 8)[1] == 8 * 10**9
    with pytest.raises(ValueError, match="unknown profile"):
        model_state_bytes("zero4", s, 4, "bf16", 8)


@pytest.mark.parametrize("hw,requested,expected", [
    (H100, "auto", "bf16"), (V100, "auto", "fp16"), (CPU, "auto", "fp32"),
    (Hardware("cpu", GB, GB, 1, True, False), "auto", "bf16"),       # CPU with AMX: fast bf16
    (Hardware("cuda", GB, GB, 1, False, False), "auto", "fp32"),      # GPU without 16-bit support
    (H100, "fp32", "fp32"), (H100, "fp16", "fp16"), (V100, "bf16", "bf16"), (CPU, "bf16", "bf16"),
    (CPU, "fp32", "fp32"), (H100, "bfloat16", "bf16"),
])
def test_choose_precision_matrix(hw, requested, expected):
    precision, reason = choose_precision(hw, requested)
    assert precision == expected and reason


def test_choose_precision_refuses_impossible():
    with pytest.raises(ValueError, match="fp16"):
        choose_precision(CPU, "fp16")
    with pytest.raises(ValueError, match="unknown precision"):
        choose_precision(H100, "fp8")
    assert "slow" in choose_precision(CPU, "bf16")[1]


@pytest.mark.parametrize("text,expected", [
    ("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("512MB", 512 * 10**6), ("1.5TB", 1_500_000_000_000),
    ("16 gib", 16 * 2**30), (123, 123), ("4096", 4096), ("2e9", 2 * 10**9), ("0.5 KiB", 512),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["eighty GB", "80XB", "", "-5GB", "GB", True])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(bad)


def test_format_bytes_and_inputs():
    assert format_bytes(18.2e9) == "18.2 GB" and format_bytes(512) == "512 B" and format_bytes(1.5e12) == "1.5 TB"
    assert PROFILE_ORDER[0] == "zero0" and PROFILE_ORDER[-1] == "zero3_offload"
    with pytest.raises(ValueError):
        choose_plan(stats(1e9, 1e8), H100, Activations(GB, GB), 8, 1, profiles=("zero9",))
    plan = choose_plan(stats(7e9, 0.5e9), H100, Activations(2 * GB, GB // 2), 8, 8, profiles=("zero2", "zero3"))
    assert isinstance(plan, Plan) and plan.profile == "zero2"
