"""Fine-tuning as people do it, on 2 CPU ranks against one process on the union of the
ranks' rows: a PEFT LoRA Llama, the same on a bf16 base with fp32 adapters, a Llama with
frozen embeddings and a T5 with a frozen encoder tower, each on FSDP2, FSDP2 with CPU
offload, FSDP1, ZeRO-2 and ZeRO-3 (less `cases.NOT_LAUNCHED`: FSDP1 refuses the bf16 base), with
checkpointing. Shard units mix frozen and trainable parameters (LoRA adapters beside
frozen base weights; the root's frozen embedding beside a trainable head), and in the
bf16 case dtypes (frozen bf16 beside trainable fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import torchrun
from tests.finetune.cases import (
    CASES,
    ENGINES,
    NOT_LAUNCHED,
    TOLERANCE,
    reference,
    reference_pretrained,
)
from tests.huggingface.hf_archs import ARCHS

pytest.importorskip("peft")
pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = Path(__file__).with_name("finetune_worker.py")
RUNS = [run for run in (f"{case}:{engine}" for case in CASES for engine in ENGINES)
        if run not in NOT_LAUNCHED]
PRETRAINED_RUNS = ["pretrained:fsdp2", "pretrained:zero3"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("exports")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, exports) -> dict:
    out = tmp_path_factory.mktemp("finetune") / "results.pt"
    ARCHS["llama"].build().save_pretrained(exports / "base")
    torchrun(WORKER, str(out), str(exports), *RUNS, *PRETRAINED_RUNS, timeout=900)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def references() -> dict:
    return {case: reference(case) for case in CASES}


@pytest.mark.parametrize("run", RUNS)
def test_loss_at_every_step_matches_one_process(trained, references, run):
    case = run.split(":")[0]
    assert trained[run]["losses"] == pytest.approx(references[case][0], abs=TOLERANCE, rel=0)


@pytest.mark.parametrize("run", RUNS)
def test_trainable_parameters_match_and_frozen_ones_did_not_move(trained, references, run):
    case = run.split(":")[0]
    _, want_trainable, want_frozen = references[case]
    got = trained[run]["params"]
    assert trained[run]["trainable"] == sorted(want_trainable)
    for name, want in want_trainable.items():
        torch.testing.assert_close(got[name], want, atol=TOLERANCE, rtol=0, msg=name)
    for name, want in want_frozen.items():
        assert torch.equal(got[name], want), name


def test_the_cases_really_mix_frozen_and_trainable_parameters_in_a_unit():
    import annot

    for case, (_, build) in CASES.items():
        plan = annot.plan(build())
        mixed = [u for u in (*plan.units, plan.root) if 0 < (u.trainable or 0) < u.params]
        assert mixed, case


def test_the_bf16_case_trains_fp32_adapters_beside_frozen_bf16_weights_in_a_unit():
    import annot

    model = CASES["lora-bf16"][1]()
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert (trained, frozen) == ({torch.float32}, {torch.bfloat16})
    plan = annot.plan(model)
    assert [u.path for u in plan.units if set(u.bytes) == {"bfloat16", "float32"}] == [
        u.path for u in plan.units]


@pytest.mark.parametrize("case", list(CASES))
def test_training_moved_the_trainable_parameters(references, case):
    # Otherwise matching the reference would prove nothing.
    _, trained_params, _ = references[case]
    initial = {n: p for n, p in CASES[case][1]().named_parameters() if p.requires_grad}
    moved = max((trained_params[n] - initial[n]).abs().max().item() for n in trained_params)
    assert moved > 1e-3


LORA_RUNS = [run for run in RUNS if run.startswith("lora:")]


@pytest.mark.parametrize("run", LORA_RUNS)
def test_the_adapter_export_loads_in_peft_with_the_trained_logits(trained, exports, run):
    import peft

    from tests.huggingface.hf_archs import ARCHS, probe_inputs

    loaded = peft.PeftModel.from_pretrained(ARCHS["llama"].build(), exports / run / "adapter").eval()
    with torch.no_grad():
        logits = loaded(**probe_inputs("llama")).logits
    torch.testing.assert_close(logits, trained[run]["logits"], atol=TOLERANCE, rtol=0)
    assert not (exports / run / "adapter" / "config.json").exists()  # PEFT's files only


def assert_loads_with_the_trained_logits(directory: Path, auto_class: str, model_class: str,
                                         arch: str, trained_logits: torch.Tensor) -> None:
    """transformers' ``auto_class`` loads ``directory`` as ``model_class``, whose logits on
    the probe batch are the trained sharded model's; config.json keeps the user's
    ``use_cache`` (True), not the training setting."""
    import transformers

    from tests.huggingface.hf_archs import probe_inputs

    loaded = getattr(transformers, auto_class).from_pretrained(directory).eval()
    assert type(loaded).__name__ == model_class
    with torch.no_grad():
        logits = loaded(**probe_inputs(arch)).logits
    torch.testing.assert_close(logits, trained_logits, atol=TOLERANCE, rtol=0)
    assert json.loads((directory / "config.json").read_text())["use_cache"] is True


@pytest.mark.parametrize("run", LORA_RUNS)
def test_the_merged_export_loads_in_transformers_with_the_trained_logits(trained, exports, run):
    # Merging adds B @ A into W: the same sums in another order.
    assert_loads_with_the_trained_logits(exports / run / "merged", "AutoModelForCausalLM",
                                         "LlamaForCausalLM", "llama", trained[run]["logits"])


@pytest.mark.parametrize("run", [r for r in RUNS if r.startswith("frozen-embeddings:")])
def test_a_plain_save_from_every_engine_is_the_trained_model(trained, references, exports, run):
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(exports / run / "model")
    _, want_trainable, want_frozen = references["frozen-embeddings"]
    for name, param in loaded.named_parameters():
        want = want_trainable.get(name, want_frozen.get(name))
        torch.testing.assert_close(param.detach(), want, atol=TOLERANCE, rtol=0, msg=name)
    assert json.loads((exports / run / "model" / "config.json").read_text())["use_cache"] is True


@pytest.mark.parametrize("run", [r for r in RUNS if r.startswith("frozen-encoder:")])
def test_the_frozen_encoder_export_loads_in_transformers_with_the_trained_logits(trained, exports,
                                                                                 run):
    assert_loads_with_the_trained_logits(exports / run / "model", "AutoModelForSeq2SeqLM",
                                         "T5ForConditionalGeneration", "t5", trained[run]["logits"])


@pytest.mark.parametrize("run", PRETRAINED_RUNS)
def test_from_pretrained_with_lora_trains_like_one_process(trained, exports, run):
    # Each rank read only its rows of the base checkpoint (the FSDP2 and ZeRO-3 load paths,
    # counted in tests/meta); the adapters came from the construction record.
    losses, want = reference_pretrained(str(exports / "base"))
    assert trained[run]["losses"] == pytest.approx(losses, abs=TOLERANCE, rel=0)
    for name, value in want.items():
        torch.testing.assert_close(trained[run]["params"][name], value, atol=TOLERANCE, rtol=0,
                                   msg=name)
