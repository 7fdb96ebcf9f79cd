"""Model-state figures equal DeepSpeed's own estimators for the same inputs."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from annot.memory import MemoryInputError
from annot.memory.states import ESTIMATOR_CASES, BytesPerParam, model_states

ds_zero2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
ds_zero3 = pytest.importorskip("deepspeed.runtime.zero.stage3")

MIXED_ADAM = BytesPerParam.of("fp16-mixed", "adam")
BY_KEY = {s.key: s for s in ESTIMATOR_CASES}
SETUPS = [  # total params, largest layer params, GPUs per node, nodes
    (125_000_000, 38_000_000, 1, 1),
    (1_300_000_000, 50_000_000, 8, 1),
    (70_553_706_496, 1_050_673_152, 8, 4),
    (7_000_000_000, 131_000_000, 3, 2),
]


def ours(key: str, total: int, largest: int, gpn: int, nodes: int, zero_init: bool = True):
    return model_states(BY_KEY[key], MIXED_ADAM, total_params=total, largest_layer_params=largest,
                        gpus_per_node=gpn, nodes=nodes, zero_init=zero_init)


@pytest.mark.parametrize("total, largest, gpn, nodes", SETUPS)
def test_zero2_equals_deepspeed(total, largest, gpn, nodes):
    for key, offload in (("zero2", False), ("zero2-offload-opt-cpu", True)):
        cpu, gpu = ds_zero2.estimate_zero2_model_states_mem_needs(
            total, num_gpus_per_node=gpn, num_nodes=nodes, cpu_offload=offload)
        mine = ours(key, total, largest, gpn, nodes)
        assert (mine.host, mine.gpu) == (cpu, gpu), key


@pytest.mark.parametrize("total, largest, gpn, nodes", SETUPS)
@pytest.mark.parametrize("zero_init", [True, False])
def test_zero3_equals_deepspeed(total, largest, gpn, nodes, zero_init):
    cases = (("zero3", False, False), ("zero3-offload-opt-cpu", True, False),
             ("zero3-offload-all-cpu", True, True))
    for key, offload, offload_params in cases:
        cpu, gpu, _ = ds_zero3.estimate_zero3_model_states_mem_needs(
            total, largest, num_gpus_per_node=gpn, num_nodes=nodes, cpu_offload=offload,
            cpu_offload_params=offload_params, zero_init=zero_init)
        mine = ours(key, total, largest, gpn, nodes, zero_init)
        assert (mine.host, mine.gpu) == (cpu, gpu), key


def _printed_rows(fn, *args, **kwargs) -> list[tuple[float, float]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(*args, **kwargs)
    return [(float(c), float(g)) for c, g in re.findall(r"^\s*([\d.]+)GB \|\s*([\d.]+)GB \|", out.getvalue(), re.M)]


def test_matches_the_all_cold_printouts():
    total, largest, gpn, nodes = SETUPS[2]
    rows = _printed_rows(ds_zero3.estimate_zero3_model_states_mem_needs_all_cold,
                         total_params=total, largest_layer_params=largest,
                         num_gpus_per_node=gpn, num_nodes=nodes)
    # DeepSpeed prints: offload all (zero_init on/off), offload optimizer (on/off), none (on/off).
    expected = []
    for key in ("zero3-offload-all-cpu", "zero3-offload-opt-cpu", "zero3"):
        for zero_init in (True, False):
            m = ours(key, total, largest, gpn, nodes, zero_init)
            expected.append((round(m.host / 2**30, 2), round(m.gpu / 2**30, 2)))
    assert rows == expected
    rows = _printed_rows(ds_zero2.estimate_zero2_model_states_mem_needs_all_cold,
                         total_params=total, num_gpus_per_node=gpn, num_nodes=nodes)
    expected = [
        (round(m.host / 2**30, 2), round(m.gpu / 2**30, 2))
        for m in (ours("zero2-offload-opt-cpu", total, largest, gpn, nodes), ours("zero2", total, largest, gpn, nodes))
    ]
    assert rows == expected


def test_other_precisions_and_optimizers_count_each_byte():
    P = 1000
    fp32_adam = BytesPerParam.of("fp32", "adamw")
    ddp = model_states(BY_KEY["ddp"], fp32_adam, total_params=P, largest_layer_params=10)
    assert ddp.gpu == 16 * P  # weights 4 + grads 4 + Adam 8
    sgd = model_states(BY_KEY["ddp"], BytesPerParam.of("fp32", "sgd"), total_params=P, largest_layer_params=10)
    assert sgd.gpu == 8 * P
    bf16 = model_states(BY_KEY["ddp"], BytesPerParam.of("bf16", "adamw"), total_params=P, largest_layer_params=10)
    assert bf16.gpu == 8 * P  # bf16 weights, grads and both Adam states
    zero1 = model_states(BY_KEY["zero1"], MIXED_ADAM, total_params=P, largest_layer_params=10, gpus_per_node=4)
    assert zero1.gpu == 4 * P + 16 * P // 4  # 16-bit weights + grads replicated, the rest sharded


def test_fsdp2_gathers_whole_units_and_prefetches_one():
    s = model_states(BY_KEY["fsdp2"], MIXED_ADAM, total_params=8000, largest_layer_params=10,
                     largest_unit_params=1000, gpus_per_node=8)
    assert s.gpu == 2 * 1000 * 4 + 18 * 8000 // 8
    with pytest.raises(MemoryInputError, match="largest unit"):
        model_states(BY_KEY["fsdp2"], MIXED_ADAM, total_params=8000, largest_layer_params=10)


def test_bad_inputs_are_named():
    with pytest.raises(MemoryInputError, match="unknown precision 'fp8'"):
        BytesPerParam.of("fp8", "adam")
    with pytest.raises(MemoryInputError, match="unknown optimizer 'lion'"):
        BytesPerParam.of("fp32", "lion")
    with pytest.raises(MemoryInputError, match="at least 1"):
        model_states(BY_KEY["ddp"], MIXED_ADAM, total_params=1, largest_layer_params=1, gpus_per_node=0)
