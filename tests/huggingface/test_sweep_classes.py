"""The class sweep (issue #42, tests/huggingface/sweep_classes.py), one test per case:
every architecture of transformers' image-text-to-text, seq2seq, speech seq2seq,
multimodal-LM, masked-LM and image-classification mappings and every diffusers
transformer class, through ``annot.from_pretrained(DIR, "fsdp2")`` on 2 CPU ranks
(plain, ``checkpoint=True``, and ``mixed`` where rank 1 can run text only) against the
library's own single-process ``from_pretrained``, and both ``annot plan`` commands (the
sweep lane: ``-m sweep``). Each case must pass, be refused by an annot error with its
reason, or be skipped with its reason; a failing row fails the test
(`sweep_driver.check_row`). ``ANNOT_SWEEP_ROWS=FILE`` reads and extends the rows in FILE.

The driver's pure parts (which cases ``--only`` picks, the reference of data
parallelism, the comparison, the tables) are tested here too, in the default run.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest
import torch

from tests.huggingface import sweep_driver
from tests.huggingface.sweep_classes import (
    CLASSES,
    DIFFUSERS,
    by_reason,
    class_cases,
    class_of,
    run_sweep,
    select,
)
from tests.huggingface.sweep_classes_worker import (
    DOUBLE_REASON,
    ZERO_INPUT_REASON,
    _double_reason,
    compare_whole,
    data_parallel_mean,
)
from tests.huggingface.sweep_worker import classify

TEST_NAME = "test_case_passes_or_is_refused_or_skipped_with_its_reason"


def _installed_classes() -> list[str]:
    """The sweep's classes whose library is installed."""
    have = {DIFFUSERS: importlib.util.find_spec("diffusers") is not None}
    return [kind for kind in CLASSES if have.get(kind, importlib.util.find_spec("transformers") is not None)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Listing the cases imports every diffusers transformer module (seconds): only a run
    # of the sweep lane lists them (tests/conftest.py deselects the lane in any other,
    # where an empty parameter set is deselected with it).
    if metafunc.function.__name__ == TEST_NAME:
        wanted = "sweep" in (metafunc.config.option.markexpr or "")
        metafunc.parametrize("case", class_cases(_installed_classes()) if wanted else [])


@pytest.fixture(scope="module")
def sweep_rows(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    # Only the cases selected (-k), all in one run of the driver.
    selected, out = sweep_driver.sweep_selection(request, tmp_path_factory, TEST_NAME, "case")
    return run_sweep(selected or class_cases(_installed_classes()), out)


@pytest.mark.sweep
@pytest.mark.distributed
def test_case_passes_or_is_refused_or_skipped_with_its_reason(sweep_rows, case):
    """One case's row: pass, refused or skipped with the reason, never failing."""
    row = sweep_rows[case]
    skip = sweep_driver.check_row(row, row.get("scenarios", ()), case)
    if skip:
        pytest.skip(skip)


# -- the driver's pure parts


CASES = ["image_text/llava", "seq2seq/bart", "masked_lm/bart", "diffusers/FluxTransformer2DModel"]


def test_only_picks_cases_by_model_type_class_name_or_whole_case():
    assert select(CASES, ["bart"]) == ["seq2seq/bart", "masked_lm/bart"]
    assert select(CASES, ["masked_lm/bart", "FluxTransformer2DModel"]) == \
        ["masked_lm/bart", "diffusers/FluxTransformer2DModel"]
    assert select(CASES, None) == CASES
    with pytest.raises(ValueError, match="named nosuch"):
        select(CASES, ["llava", "nosuch"])


def test_an_unknown_class_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown classes.*choose from image_text"):
        class_cases(["image_txt"])


def _step(loss: float, **grads: list[float]) -> tuple[float, dict[str, torch.Tensor], list[str]]:
    return loss, {n: torch.tensor(g) for n, g in grads.items()}, ["a", "b"]


def test_the_reference_is_the_mean_step_and_a_missing_gradient_counts_zero():
    loss, grads, trainable = data_parallel_mean([_step(1.0, a=[2.0], b=[4.0]), _step(3.0, a=[4.0])])
    assert loss == 2.0 and trainable == ["a", "b"]
    assert grads["a"].tolist() == [3.0] and grads["b"].tolist() == [2.0]  # b: (4 + 0) / 2


def test_a_nonzero_gradient_the_reference_lacks_is_a_difference():
    ref = _step(1.0, a=[1.0])
    same = (1.0, {"a": torch.tensor([1.0]), "b": torch.tensor([0.0])}, ["a", "b"])
    assert "difference" not in compare_whole(ref, same)
    extra = (1.0, {"a": torch.tensor([1.0]), "b": torch.tensor([0.5])}, ["a", "b"])
    assert "non-zero gradients the reference has not: ['b']" in compare_whole(ref, extra)["difference"]


def test_a_huge_gradient_is_compared_relative_to_its_size_and_a_wrong_one_still_differs():
    """BLIP-2's tiny model: gradients of 1e10 (zero-initialised query tokens normalised),
    where float32 sums in another order differ by thousands, a few millionths."""
    ref = _step(1.0, a=[2.3e10, 1.0])
    rounded = (1.0, {"a": torch.tensor([2.3e10 + 16384.0, 1.0])}, ["a", "b"])
    assert "difference" not in compare_whole(ref, rounded)
    doubled = (1.0, {"a": torch.tensor([4.6e10, 1.0])}, ["a", "b"])
    assert "gradient of a off by" in compare_whole(ref, doubled)["difference"]
    small_off = (1.0, {"a": torch.tensor([2.3e10, 1.001])}, ["a", "b"])  # 1e-3 on an element of 1
    assert "gradient of a off by" in compare_whole(ref, small_off)["difference"]


PASSED = {"loss_rel": 0.0, "grad_max": 0.0}
PLANNED = {"plan": {"rc": 0, "stderr": ""}, "plan_memory": {"rc": 0, "stderr": ""}}


def test_float64_only_for_batch_norm_or_query_tokens_of_zeros():
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert _double_reason(plain) is None
    torch.nn.init.zeros_(plain[0].weight)  # zero tables and weights feed no norm: float32
    assert _double_reason(plain) is None
    queries = torch.nn.Module()
    queries.query_tokens = torch.nn.Parameter(torch.zeros(1, 3, 4))
    assert _double_reason(queries) == ZERO_INPUT_REASON
    assert _double_reason(torch.nn.Sequential(torch.nn.BatchNorm2d(3))) == DOUBLE_REASON


def test_the_mixed_scenario_decides_the_row_where_it_ran():
    row = {**PLANNED, "fsdp2": PASSED, "fsdp2_checkpoint": PASSED, "mixed": {"crash": "KeyError: 'x' at f.py:1"}}
    assert classify(row, ("fsdp2", "fsdp2_checkpoint")) == ("pass", "")
    assert classify(row, ("fsdp2", "fsdp2_checkpoint", "mixed")) == ("failing", "crash: KeyError: 'x' at f.py:1")


def test_the_planners_refusal_of_a_value_reading_model_is_a_refusal_and_other_exits_fail():
    """`annot plan --memory` names what it cannot trace (a forward reading a tensor's
    value); any other failed plan command still fails the row."""
    from annot.cli.main import CANNOT_TRACE_VALUES

    said = f"annot plan: error: IBertForMaskedLM.forward reads a tensor's value (...), {CANNOT_TRACE_VALUES}: ...\n"
    row = {"plan": {"rc": 0, "stderr": ""}, "plan_memory": {"rc": 2, "stderr": said}, "fsdp2": PASSED}
    outcome, reason = classify(row, ("fsdp2",))
    assert outcome == "refused" and reason.startswith("annot plan DIR --memory: annot plan: error: IBert")
    row["plan_memory"] = {"rc": 2, "stderr": "annot plan: error: tracing X.forward for --memory failed: boom\n"}
    assert classify(row, ("fsdp2",))[0] == "failing"
    row["fsdp2"] = {"crash": "KeyError at f.py:1"}  # a crash in training outranks the planner's refusal
    assert classify(row, ("fsdp2",))[0] == "failing"


def _rows() -> dict[str, dict[str, Any]]:
    rows = [("image_text/llava", "pass", ""), ("image_text/qwen2_vl", "pass", ""),
            ("image_text/llama4", "skipped", "transformers fails a training step: reads image_outputs"),
            ("seq2seq/t5", "failing", "silent difference: gradient of w off by 1e-3 > 0.0001"),
            ("diffusers/FluxTransformer2DModel", "refused", "ShardingError: mixed dtypes")]
    return {case: {"case": case, "outcome": outcome, "reason": reason} for case, outcome, reason in rows}


def test_the_tables_count_each_class_and_group_reasons_by_class():
    table = sweep_driver.outcome_table(_rows(), class_of, "class").splitlines()
    assert "| image_text | 2 | 0 | 1 | 0 | 3 |" in table
    assert "| diffusers | 0 | 1 | 0 | 0 | 1 |" in table
    reasons = by_reason(_rows()).splitlines()
    assert reasons[0] == "| class | outcome | reason | count | architectures |"
    assert "| image_text | pass |  | 2 | llava, qwen2_vl |" in reasons
    assert "| image_text | skipped | transformers fails a training step | 1 | llama4 |" in reasons
    assert "| seq2seq | failing | silent difference | 1 | t5 |" in reasons


def test_a_died_launch_is_a_failing_row_of_its_case_and_rerun_forgets_it(tmp_path):
    out = tmp_path / "rows.jsonl"
    sweep_driver.append_row(out, {"case": "seq2seq/t5", "outcome": "pass"})
    sweep_driver.append_row(out, sweep_driver.died_row("masked_lm/bert", "a\n\nSegmentation fault\n", "case"))
    rows = sweep_driver.read_rows(out, "case")
    assert rows["masked_lm/bert"]["outcome"] == "failing"
    assert rows["masked_lm/bert"]["reason"] == "the launch died while running it: a | Segmentation fault"
    (sweep_driver.prepared_root(out) / "masked_lm/bert").mkdir(parents=True)
    sweep_driver.forget(out, ["masked_lm/bert"], "case")
    assert [json.loads(line)["case"] for line in out.read_text().splitlines()] == ["seq2seq/t5"]
    assert not (sweep_driver.prepared_root(out) / "masked_lm/bert").exists()


def test_a_case_whose_prepare_killed_the_process_is_recorded_as_failing(tmp_path):
    # A native crash in the single-process stage (Emu3's, once) leaves the case's mark
    # and no row: the next run records it as failing instead of dying on it again.
    root = tmp_path / "rows.jsonl.prepared"
    (root / "image_text" / "crashes").mkdir(parents=True)
    (root / "image_text" / "crashes" / sweep_driver.PREPARING).touch()
    prepared = []

    def prepare(name, directory):
        prepared.append(name)
        return {"case": name, "outcome": None}

    sweep_driver.prepare_all(["image_text/crashes", "image_text/fine"], root, prepare, key="case")
    rows = {name: json.loads((root / name / sweep_driver.PREPARED).read_text())
            for name in ("image_text/crashes", "image_text/fine")}
    assert prepared == ["image_text/fine"]
    assert rows["image_text/crashes"]["outcome"] == "failing"
    assert "died while preparing" in rows["image_text/crashes"]["reason"]
    assert rows["image_text/fine"]["outcome"] is None
    assert not (root / "image_text" / "fine" / sweep_driver.PREPARING).exists()
