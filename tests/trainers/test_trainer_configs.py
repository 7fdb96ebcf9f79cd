"""What Lightning's DeepSpeedStrategy, the HuggingFace Trainer and Accelerate accept from
annot, checked through their own validation code on CPU (Lightning refuses DeepSpeed
and FSDP strategies there; Accelerate turns FSDP on only for GPUs), and evaluated on a
fresh copy of the model."""

from __future__ import annotations

import copy

import pytest
import torch

import annot
from annot.policies import Policy, by_class, by_name, every_nth
from examples.gpt.model import GPT, Block


@pytest.fixture
def hf_training_arguments():
    """transformers 5.24's ``TrainingArguments`` sets up Accelerate's distributed state,
    which joins a one-rank gloo process group in this process: left alone, it made a later
    test's ``init_process_group`` fail ("twice") and a forked child hang in its barrier.
    Torn down with Accelerate's state after the test."""
    transformers = pytest.importorskip("transformers")
    yield transformers.TrainingArguments
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()

def gpt() -> GPT:
    return GPT(n_layer=4, n_embd=32, n_head=2, vocab_size=64, block_size=16)


# deepspeed_config(for_=...) ------------------------------------------------------------

@pytest.mark.slow  # Lightning's DeepSpeedStrategy imports deepspeed (~10 s)
def test_lightning_deepspeed_strategy_formats_annots_config():
    L = pytest.importorskip("lightning")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    config = annot.deepspeed_config(gpt(), stage=3, for_="lightning")
    assert "gradient_accumulation_steps" not in config and "gradient_clipping" not in config
    strategy = DeepSpeedStrategy(config=config)
    # Lightning's own formatting, as at setup, with a Trainer's settings (4 accumulation
    # steps, the default clip value 0); its precision plugin is the default fp32 one.
    trainer = L.Trainer(accelerator="cpu", devices=1, accumulate_grad_batches=4, logger=False)

    class Lit(L.LightningModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(list(range(10)), batch_size=5)

    lit = Lit()
    lit.trainer = trainer
    trainer.fit_loop._data_source.instance = lit
    strategy._lightning_module = lit
    strategy._format_config()
    assert strategy.config["train_micro_batch_size_per_gpu"] == 5  # from the loader
    assert strategy.config["gradient_accumulation_steps"] == 4
    assert strategy.config["gradient_clipping"] == 0.0
    assert strategy.config["zero_optimization"]["stage"] == 3
    assert strategy.config["activation_checkpointing"]["number_checkpoints"] == 4
    # The plain config is what Lightning refused (the first DeepSpeed failure).
    plain = DeepSpeedStrategy(config=annot.deepspeed_config(gpt(), stage=3))
    plain._lightning_module = lit
    with pytest.raises(Exception, match="gradient_accumulation_steps"):
        plain._format_config()


@pytest.mark.slow
def test_hf_trainer_fills_annots_config_from_its_arguments(tmp_path, hf_training_arguments):
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    config = annot.deepspeed_config(gpt(), stage=2, for_="hf")
    args = hf_training_arguments(output_dir=str(tmp_path), per_device_train_batch_size=3,
                                          gradient_accumulation_steps=2, max_grad_norm=0.5,
                                          report_to=[], use_cpu=True)
    hf = HfTrainerDeepSpeedConfig(copy.deepcopy(config))
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, gpt(), num_training_steps=10)  # raises on a mismatch
    assert hf.config["train_micro_batch_size_per_gpu"] == 3
    assert hf.config["gradient_accumulation_steps"] == 2
    assert hf.config["gradient_clipping"] == 0.5
    # The plain config disagrees with the Trainer's defaults and is refused by it.
    plain = HfTrainerDeepSpeedConfig(annot.deepspeed_config(gpt(), stage=2))
    plain.trainer_config_process(args)
    with pytest.raises(ValueError, match="per_device_train_batch_size"):
        plain.trainer_config_finalize(args, gpt(), num_training_steps=10)


@pytest.mark.parametrize("for_, given, owner", [
    ("lightning", dict(gradient_accumulation_steps=4), "accumulate_grad_batches"),
    ("lightning", dict(precision="bf16"), "Trainer(precision"),
    ("hf", dict(gradient_clipping=1.0), "max_grad_norm"),
    ("hf", dict(micro_batch_size=8), "per_device_train_batch_size"),
])
def test_a_setting_the_trainer_owns_is_refused_with_where_it_goes(for_, given, owner):
    with pytest.raises(ValueError, match=owner.replace("(", r"\(")):
        annot.deepspeed_config(gpt(), for_=for_, **given)


# apply_checkpointing ------------------------------------------------------------------

def test_apply_checkpointing_follows_the_plan_on_a_model_another_tool_wraps():
    model = gpt()
    paths = annot.apply_checkpointing(model, Policy(shard=by_class(Block),
                                                     checkpoint=every_nth(2, by_class(Block))))
    assert paths == ["transformer.h.0", "transformer.h.2"]
    from annot.runtime.activation_checkpoint import is_checkpointed
    assert [n for n, m in model.named_modules() if is_checkpointed(m)] == paths
    assert list(model.state_dict()) == list(gpt().state_dict())  # names unchanged


def test_apply_checkpointing_refuses_a_plan_that_checkpoints_nothing():
    with pytest.raises(ValueError, match="checkpoints no module"):
        annot.apply_checkpointing(gpt(), Policy(shard=by_class(Block)))


# Accelerate ---------------------------------------------------------------------------

def test_accelerates_fsdp2_plugin_takes_the_plans_classes_and_wraps_them_on_a_fresh_model():
    pytest.importorskip("accelerate")
    from accelerate.utils import FullyShardedDataParallelPlugin

    from annot.accelerate import fsdp_plugin_kwargs

    kwargs = fsdp_plugin_kwargs(gpt())
    assert kwargs["transformer_cls_names_to_wrap"] == ["Block"]
    assert kwargs["activation_checkpointing"] is True  # the marks checkpoint every block
    plugin = FullyShardedDataParallelPlugin(**kwargs)
    fresh = gpt()
    plugin.set_auto_wrap_policy(fresh)   # what accelerate's fsdp2_prepare_model runs
    chosen = [n for n, m in fresh.named_modules() if plugin.auto_wrap_policy(m, False, 0)]
    assert chosen == [u.path for u in annot.plan(fresh).units]


def test_hf_trainer_takes_the_plans_fsdp_config(tmp_path, hf_training_arguments):
    import transformers

    from annot.accelerate import hf_fsdp_config

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4)
    model = transformers.LlamaForCausalLM(config)
    fsdp_config = hf_fsdp_config(model, checkpoint=True)
    assert fsdp_config["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    args = hf_training_arguments(output_dir=str(tmp_path), fsdp="full_shard",
                                          fsdp_config=fsdp_config, report_to=[], use_cpu=True)
    plugin = args._process_fsdp_args()
    assert plugin["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"
    assert plugin["activation_checkpointing"] is True and plugin["fsdp_version"] == 2


@pytest.mark.parametrize("policy, match", [
    (Policy(shard=by_name("transformer.h.0", "transformer.h.1")), "not transformer.h.2"),
    (Policy(shard=by_class(Block), checkpoint=every_nth(2, by_class(Block))), "some units"),
])
def test_a_plan_class_names_cannot_express_is_refused(policy, match):
    from annot.accelerate import fsdp_plugin_kwargs

    with pytest.raises(ValueError, match=match):
        fsdp_plugin_kwargs(gpt(), policy)


def test_checkpoint_false_turns_accelerates_checkpointing_off():
    from annot.accelerate import fsdp_plugin_kwargs

    assert fsdp_plugin_kwargs(gpt(), checkpoint=False)["activation_checkpointing"] is False


# fp16: the tool owns loss scaling ------------------------------------------------------

@pytest.mark.parametrize("policy", ["fp16", torch.float16, {"param_dtype": torch.float16}])
def test_an_fp16_policy_for_accelerate_warns_that_the_accelerator_must_scale(policy):
    from annot.accelerate import fsdp_plugin_kwargs

    with pytest.warns(UserWarning, match="Accelerator\\(mixed_precision='fp16'\\)"):
        fsdp_plugin_kwargs(gpt(), mixed_precision_policy=policy)


def test_a_bf16_policy_for_accelerate_does_not_warn(recwarn):
    from annot.accelerate import fsdp_plugin_kwargs

    fsdp_plugin_kwargs(gpt(), mixed_precision_policy="bf16")
    assert not [w for w in recwarn if "fp16" in str(w.message)]


@pytest.mark.parametrize("strategy", ["Strategy", "FabricStrategy"])
def test_lightning_strategies_refuse_fp16_they_cannot_scale(strategy):
    pytest.importorskip("lightning")
    import annot.lightning

    with pytest.raises(ValueError, match="no loss scaler"):
        getattr(annot.lightning, strategy)(mixed_precision="fp16")


def test_lightning_parallelize_refuses_fp16_before_touching_the_model():
    from annot.lightning import parallelize

    model = gpt()
    with pytest.raises(ValueError, match="Trainable scales the loss"):
        parallelize(model, None, mixed_precision="fp16")  # type: ignore[arg-type]  # refused before the mesh is read
    assert not annot.engines.fsdp2.holds_fsdp2(model)
