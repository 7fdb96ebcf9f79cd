"""The ``annot`` command: ``annot plan`` and ``annot rewrite``.

Only the standard library is imported at module level: ``annot rewrite`` hands over to
the `rewriter` package (which never imports torch) and ``annot plan`` imports torch when
it runs. Exit codes: 0 success; 1 the plan is invalid (the errors are printed);
2 bad input (missing file, unknown class, bad JSON, ...), one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import typing
from collections.abc import Sequence

__all__ = ["main"]

PLAN_EPILOG = """\
targets:
  path/to/model.py:ClassName   a class built with --kwargs/--config as keyword arguments
  hf:<model_type>              a transformers architecture (hf:llama), config from --kwargs/--config
  path/to/dir                  a local HuggingFace model directory (config.json: transformers
                               or diffusers), or a diffusers pipeline (model_index.json: its
                               denoiser)

rules (--policy, --checkpoint, --offload):
  class:NAME[,NAME]  name:GLOB  size:COUNT (100M, 1e8)  marked[:ACTION]  hf  repeated
  every(N, RULE)     combined with | (either), & (both), - (except) and ( )
  Without --policy/--checkpoint/--offload the model's marks decide, else HuggingFace
  _no_split_modules (shard and checkpoint).

exit codes: 0 plan printed; 1 the plan is invalid (errors printed); 2 bad input;
  3 nothing fits --budget (one line: the smallest budget that would).
"""


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line naming the problem and where help is
    (argparse's default prints the whole usage block first; issue #33)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="show which modules get sharded, checkpointed, offloaded (allocates nothing)",
        description="Build the model on the meta device and print its Plan.",
        epilog=PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", help="path/to/model.py:ClassName, hf:<model_type> or a model directory")
    p.add_argument("--kwargs", metavar="JSON", help="constructor or config values as a JSON object")
    p.add_argument("--config", metavar="FILE", help="constructor or config values from a JSON/YAML file")
    p.add_argument("--policy", metavar="RULE", help="modules to shard (see rules below)")
    p.add_argument("--checkpoint", metavar="RULE", help="modules to checkpoint")
    p.add_argument("--offload", metavar="RULE", help="modules to offload")
    p.add_argument("--offload-to", choices=("cpu", "nvme"), default="cpu",
                   help="where --offload units go (default: cpu)")
    p.add_argument("--group-tied", action="store_true",
                   help="shard modules sharing a parameter as one unit instead of failing")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="cast the (meta) model before planning, e.g. bfloat16 weights")
    p.add_argument("--lora", type=int, metavar="RANK",
                   help="LoRA of rank RANK on every linear but the output layer (PEFT's "
                        "'all-linear'), the base frozen: what fine-tuning keeps in memory")
    p.add_argument("--quantize", choices=("nf4",),
                   help="with --lora: the frozen base quantized as from_pretrained(..., "
                        "quantize='nf4') does it (QLoRA; needs torchao): which linears, and "
                        "with --memory and --budget their bytes (DDP and FSDP2 rows only)")
    p.add_argument("--unquantized", metavar="RULE",
                   help="with --quantize: modules whose linears stay in the model's dtype "
                        "(a rule, e.g. 'name:**.o_proj')")
    p.add_argument("--float8", metavar="RECIPE", choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
                   help="the repeated blocks' eligible linears compute in float8 as auto_wrap(float8=RECIPE) "
                        "makes them (tensorwise, rowwise, rowwise_with_gw_hp): the Plan's float8 "
                        "column, and with --memory their casts, saved inputs and float8 all-gather")
    p.add_argument("--compile", action="store_true",
                   help="the repeated blocks compiled, as auto_wrap(compile=True) does (shown per unit)")
    p.add_argument("--json", action="store_true", help="print the Plan as JSON")
    p.add_argument("--parallel", metavar="DIMS",
                   help="parallel dimensions, e.g. replicate=2,shard=-1 (HSDP: 2 replicas, each "
                        "sharded over the rest); their product is --gpus x --nodes")
    memory = p.add_argument_group("memory (--memory)")
    memory.add_argument("--memory", action="store_true",
                        help="estimate per-GPU memory of every strategy and recommend one")
    memory.add_argument("--gpus", "--gpus-per-node", dest="gpus", type=int, default=1,
                        help="GPUs per node (default: 1)")
    memory.add_argument("--nodes", type=int, default=1, help="nodes (default: 1)")
    memory.add_argument("--batch", type=int, default=1, help="micro-batch per GPU (default: 1)")
    memory.add_argument("--seq", type=int, default=None,
                        help="sequence length (default: 2048, or the model's longest if shorter: "
                             "max_position_embeddings, n_positions)")
    memory.add_argument("--image-size", type=int, metavar="PIXELS",
                        help="a vision-language or image model's images: pixels a side (default: "
                             "its vision config's); their tokens count in --seq")
    memory.add_argument("--images", type=int, default=1, metavar="N",
                        help="images per sample of a vision-language model (default: 1)")
    memory.add_argument("--audio-frames", type=int, metavar="N",
                        help="a speech or audio model's input frames (default: what its encoder takes)")
    memory.add_argument("--latent-size", type=int, metavar="N",
                        help="a diffusion transformer's latent height and width before patching "
                             "(default: 8)")
    memory.add_argument("--frames", type=int, metavar="N",
                        help="a video diffusion transformer's latent frames (default: 2)")
    memory.add_argument("--text-tokens", type=int, metavar="N",
                        help="a diffusion transformer's prompt tokens (default: 8)")
    memory.add_argument("--precision", default=None,
                        choices=("fp32", "amp", "bf16-mixed", "fp16-mixed", "bf16"),
                        help="fp32; amp (fp32 states, torch.autocast); 16-bit mixed with fp32 "
                             "master weights; or pure bf16 (default: bf16-mixed, or amp for a "
                             "model whose forward fails with 16-bit parameters, said under the table)")
    memory.add_argument("--optimizer", default="adamw",
                        choices=("adamw", "adam", "adamw-for-loop", "adam-for-loop", "sgd-momentum", "sgd"),
                        help="default: adamw (torch's foreach step); *-for-loop: no states-sized "
                             "step temporary (foreach=False, DeepSpeed's FusedAdam/CPUAdam)")
    memory.add_argument("--gpu", metavar="KIND", choices=("H100", "H200", "A100", "A100-40GB"),
                        help="GPU kind (H100, H200, A100, A100-40GB): its memory and reserve "
                             "(default: the visible GPU, else H100)")
    memory.add_argument("--gpu-mem", metavar="SIZE",
                        help="memory per GPU, e.g. 80GiB (default: the --gpu kind's, else the "
                             "visible GPU's, else an H100's 79.6GiB)")
    memory.add_argument("--deepspeed-config", metavar="FILE",
                        help="your DeepSpeed config (JSON): one more row modelled from its ZeRO "
                             "stage, offload, buckets, prefetch and live/reuse limits, fp16/bf16")
    memory.add_argument("--host-mem", metavar="SIZE",
                        help="memory per host, e.g. 512GiB (default: this machine's RAM)")
    memory.add_argument("--margin", type=float, default=None,
                        help="fraction added to each counted GPU peak for what no count sees "
                             "(allocator rounding, fragmentation; default: 0.10)")
    memory.add_argument("--fit", metavar="NAME",
                        help="the largest value of the integer option NAME (n_layer, "
                             "num_hidden_layers, ...) each strategy fits, and the largest --batch "
                             "at the given model")
    memory.add_argument("--fit-strategies", metavar="KEYS", default="ddp,zero3,zero3-offload",
                        help="strategies for --fit, comma-separated (default: ddp,zero3,zero3-offload)")
    memory.add_argument("--reserve", metavar="SIZE",
                        help="bytes per GPU no count sees (default: the GPU kind's CUDA context, "
                             "cuBLAS workspaces and NCCL buffers per communicator)")
    memory.add_argument("--intra-node-bw", metavar="GB/S", type=float, default=None,
                        help="bandwidth each GPU sends at inside its node, GB/s (default: 150, "
                             "NVLink-class)")
    memory.add_argument("--inter-node-bw", metavar="GB/S", type=float, default=None,
                        help="bandwidth each node sends at to the others, all its NICs together, "
                             "GB/s (default: 25, one 200 Gb/s NIC; 1 for a 1000 MB/s link)")
    memory.add_argument("--tflops", type=float, default=None,
                        help="sustained TFLOP/s per GPU for the step time (default: 150, an A100 "
                             "at about half its bf16 peak)")
    memory.add_argument("--cp", metavar="SIZES", default="",
                        help="context-parallel sizes to weigh, comma-separated (e.g. 2,4,8): "
                             "rows FSDP2 + CP c, each sequence split over c GPUs of a node")
    memory.add_argument("--cp-attention", choices=("allgather", "ulysses"), default="allgather",
                        help="how the --cp rows split attention: keys and values all-gathered "
                             "(default) or Ulysses' all-to-all over heads")
    budget = p.add_argument_group("memory budget (--memory --budget SIZE)")
    budget.add_argument("--budget", metavar="SIZE",
                        help="choose the strategy and, per block, none/selective/checkpoint/"
                             "checkpoint_offload/offload for the fastest step within SIZE per GPU "
                             "(e.g. 40GiB); --json gives the auto_wrap call")
    budget.add_argument("--device", default="H100", metavar="KIND",
                        help="the cost model's device: H100, H200, A100 or cpu (default: H100; "
                             "--tflops, --hbm-bw, --host-bw override its figures)")
    budget.add_argument("--hbm-bw", metavar="GB/S", type=float, default=None,
                        help="device memory bandwidth for recomputed element-wise work")
    budget.add_argument("--host-bw", metavar="GB/S", type=float, default=None,
                        help="host link bandwidth each direction for offload (0: no offload)")
    budget.add_argument("--plot", metavar="FILE",
                        help="draw per-GPU memory per strategy against the budget (.png or .svg; "
                             "needs matplotlib: pip install 'annot-train[plot]')")
    p.add_argument("--full", action="store_true",
                   help="one table row per unit (default: runs of identical blocks share a row)")


def _rewrite_stub(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("rewrite", help="insert activation checkpointing into model source (libcst)",
                   add_help=False)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="annot",
        description="Shard, checkpoint and offload PyTorch models too large for one GPU.",
    )
    parser.add_argument("--version", action="version", version=f"annot {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _plan_parser(sub)
    _rewrite_stub(sub)
    return parser


def _version() -> str:
    from annot._version import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "rewrite":
        # Before argparse and before anything imports torch: `annot rewrite --help` is fast.
        from annot.rewriter.cli import main as rewrite_main

        return rewrite_main(argv[1:], prog="annot rewrite")
    args = _parser().parse_args(argv)
    if args.command == "plan":
        # Whether --precision was given: a default the model cannot run is replaced (amp).
        args.precision_given = args.precision is not None
        args.precision = args.precision or DEFAULT_PRECISION
        return _run_plan(args)
    raise AssertionError(f"unhandled command {args.command}")


def _run_plan(args: argparse.Namespace) -> int:
    from annot.cli.targets import build_target, read_options
    from annot.planning import plan as plan_model
    from annot.policies import AnnotError, PlanError, Policy, default_policy, parse_rule

    try:
        for option in ("batch", "seq"):
            if getattr(args, option) is not None and getattr(args, option) < 1:
                raise ValueError(f"--{option} must be at least 1, got {getattr(args, option)}")
        for option in ("intra_node_bw", "inter_node_bw", "tflops"):
            value = getattr(args, option)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{option.replace('_', '-')} must be a positive number, got {value}")
        gpu_mem = _size(args.gpu_mem, "--gpu-mem")
        host_mem = _size(args.host_mem, "--host-mem")
        reserve = _size(args.reserve, "--reserve")
        options = read_options(args.kwargs, args.config)
        rules = {
            action: parse_rule(text)
            for action, text in (("shard", args.policy), ("checkpoint", args.checkpoint),
                                 ("offload", args.offload))
            if text is not None
        }
        if args.unquantized is not None and args.quantize is None:
            raise ValueError("--unquantized goes with --quantize")
        if args.quantize is not None and args.lora is None:
            raise ValueError("--quantize quantizes a frozen base: add --lora RANK")
        if args.float8 is not None and args.quantize is not None:
            raise ValueError("--float8 with --quantize: annot does not train a quantized base in float8")
        if args.lora is not None and args.fit:
            raise ValueError("--fit rebuilds the model at each size without --lora: leave one out")
        model = _with_lora(build_target(args.target, options, dtype=args.dtype), args.lora)

        def plan_of(model):
            # annot.plan: make_plan plus the notes the model's builder left (pitfall 46).
            if rules or args.group_tied:
                base = Policy(shard=rules.get("shard"), checkpoint=rules.get("checkpoint"),
                              offload=rules.get("offload")) if rules else default_policy(model)
                policy = Policy(shard=base.shard, checkpoint=base.checkpoint, offload=base.offload,
                                offload_to=args.offload_to, group_tied=args.group_tied)
            else:
                policy = None
            return plan_model(model, policy, float8=args.float8, compile=args.compile or None)

        plan = plan_of(model)
        if args.parallel is not None:
            from dataclasses import replace

            from annot.policies.parallel import ParallelDims

            world = args.gpus * args.nodes
            try:
                dims = ParallelDims.parse(args.parallel).resolve(world)
            except ValueError as exc:
                raise ValueError(f"--parallel on --gpus {args.gpus} x --nodes {args.nodes}: {exc}") from None
            plan = replace(plan, parallel=dims)
        quantized = None
        if args.quantize is not None:
            from annot.quantization import choose_linears, quantized_plan

            world = args.gpus * args.nodes
            linears = choose_linears(model, world, args.unquantized)
            plan = quantized_plan(plan, model, linears)
            quantized = (f"on {world} rank{'s' if world > 1 else ''} (--gpus x --nodes), "
                         + linears.describe().replace("\n", "; "))
    except PlanError as exc:
        for line in str(exc).splitlines():
            print(f"annot plan: invalid plan: {line}", file=sys.stderr)
        return 1
    except (AnnotError, ValueError) as exc:
        print(f"annot plan: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file the checks above did not foresee: still one line
        print(f"annot plan: error: {exc.filename or args.target}: {exc.strerror or exc}; check "
              "that it exists and this user may read it", file=sys.stderr)
        return 2
    if not args.memory:
        print(plan.to_json() if args.json else plan.table(collapse=not args.full))
        if quantized is not None and not args.json:
            print(f"note: {quantized}")
        return 0
    if args.fit:
        return _run_fit(args, model, options, plan_of, gpu_mem, host_mem, reserve)
    if args.budget is not None or args.plot is not None:
        from annot.cli.budget import run_budget

        try:
            budget = _size(args.budget, "--budget")
        except ValueError as exc:
            print(f"annot plan: error: {exc}", file=sys.stderr)
            return 2
        return run_budget(args, model, plan, budget, reserve)
    from annot.cli.budget import cp_sizes, media_sizes
    from annot.memory import MARGIN, estimate_memory
    from annot.memory.communication import INTER_NODE_BW, INTRA_NODE_BW, TFLOPS

    def given(value: float | None, default: float) -> float:
        return default if value is None else value

    def estimate(precision: str, seq: int):
        return estimate_memory(
            model, plan, gpus=args.gpus, nodes=args.nodes, batch=args.batch, seq=seq,
            precision=precision, optimizer=args.optimizer,
            gpu_mem=gpu_mem, host_mem=host_mem,
            margin=MARGIN if args.margin is None else args.margin, reserve=reserve,
            intra_node_bw=given(args.intra_node_bw, INTRA_NODE_BW),
            inter_node_bw=given(args.inter_node_bw, INTER_NODE_BW), tflops=given(args.tflops, TFLOPS),
            cp=cp_sizes(args.cp), cp_attention=args.cp_attention,
            deepspeed_config=args.deepspeed_config, gpu=args.gpu, media=media_sizes(args),
            quantize=args.quantize, unquantized=args.unquantized,
        )

    notes: list[str] = []
    seq = args.seq or default_seq(model)
    try:
        try:
            report = estimate(args.precision, seq)
        except Exception as exc:
            if args.precision_given or not fails_in_16_bit(exc, args.precision):
                raise
            fallback = FALLBACK_PRECISION
            try:
                report = estimate(fallback, seq)
            except Exception as again:
                # Under autocast too (Cosmos-3-Omni scatters bf16 values into an fp32
                # buffer): the model trains in fp32 only.
                if not fails_in_16_bit(again, "bf16-mixed"):
                    raise
                fallback = "fp32"
                report = estimate(fallback, seq)
            kind = ("fp32 parameters and states, bf16 autocast" if fallback == FALLBACK_PRECISION
                    else "it fails under bf16 autocast too")
            notes.append(f"{type(model).__name__}.forward fails with 16-bit parameters "
                         f"({type(exc).__name__}: {_first_line(exc)}), which the default --precision {args.precision} "
                         f"gives it: planned with --precision {fallback} instead ({kind}); --precision chooses")
            args.precision = fallback
    except (AnnotError, ValueError) as exc:
        hint = ""
        if "more than 1 value per channel" in str(exc):  # torch's batch norm, training mode
            hint = (f" (a batch norm normalizes over the batch in training, and --batch {args.batch} "
                    "leaves it one value per channel, in training too: plan the batch you train, "
                    "--batch 2 or more)")
        print(f"annot plan: error: {exc}{hint}", file=sys.stderr)
        return 2
    except Exception as exc:  # the model's own forward failed under fake tensors
        retried = _shorter_default_seq(args, model, seq, lambda s: estimate(args.precision, s), exc)
        if retried is None:
            print(f"annot plan: error: {trace_failure(model, exc, args.precision)}", file=sys.stderr)
            return 2
        report, note = retried
        notes.append(note)
    notes += _unpriced(plan)
    if quantized is not None:
        notes.append(quantized)
    if args.json:
        print(json.dumps({"plan": plan.to_dict(), "memory": report.to_dict(), "notes": notes}, indent=2))
    else:
        print(plan.table(collapse=not args.full))
        print()
        print(report.table())
        for note in notes:
            print(f"note: {note}")
    return 0


def _with_lora(model, rank: int | None):
    """``model`` with LoRA of rank ``rank`` on every linear but the output layer, its
    base frozen (PEFT's ``get_peft_model``); ``model`` itself for ``rank=None``."""
    if rank is None:
        return model
    if rank < 1:
        raise ValueError(f"--lora must be at least 1, got {rank}")
    try:
        import peft
    except ImportError:
        raise ValueError("--lora needs PEFT: pip install peft") from None
    return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank,
                                                      target_modules="all-linear"))


#: The shortest sequence `_shorter_default_seq` tries.
SHORTEST_DEFAULT_SEQ = 128


def _shorter_default_seq(args: argparse.Namespace, model, seq: int, estimate, failure: Exception):
    """When ``--seq`` was not given and the trace failed at the default length (the
    config's ``max_position_embeddings``, which a model may not reach: ProphetNet's
    n-gram streams take positions beyond it, and it fails at 511 of its 512 for real
    too), the report at the longest shorter length (halving, down to
    `SHORTEST_DEFAULT_SEQ`) that traces, and a note saying so; ``None`` when --seq was
    given or no length traces."""
    if args.seq is not None:
        return None
    shorter = seq // 2
    while shorter >= SHORTEST_DEFAULT_SEQ:
        try:
            report = estimate(shorter)
        except Exception:  # noqa: BLE001 - the model's own forward again: try shorter
            shorter //= 2
            continue
        return report, (f"traced at --seq {shorter}: {type(model).__name__}.forward fails at the "
                        f"default {seq} ({type(failure).__name__}: {_first_line(failure)}); "
                        "--seq chooses the length")
    return None


def _unpriced(plan) -> list[str]:
    """What the Plan asks for that the memory rows do not price, said with the table."""
    dims = plan.parallel
    if dims is None or dims.ep == 1:
        return []
    return [f"expert parallelism (ep={dims.ep}) is not priced: each row shards the expert "
            "stacks over the data-parallel ranks like any parameter. With ep a rank keeps the "
            "same share of expert weights and states, gathers only its ep group's share of "
            "each layer's experts, and sends its tokens' hidden states by all-to-all instead"]


def _run_fit(args: argparse.Namespace, model, options, plan_of, gpu_mem, host_mem, reserve) -> int:
    """``--memory --fit NAME``: the largest NAME per strategy, and the largest batch."""
    from annot.cli.budget import media_sizes
    from annot.cli.targets import build_target
    from annot.memory import MARGIN, RESERVE
    from annot.memory.fit import format_fit, largest_fit
    from annot.memory.gpu_kinds import gpu_kind
    from annot.memory.inputs import model_inputs
    from annot.policies import AnnotError

    at = options.get(args.fit, getattr(getattr(model, "config", None), args.fit, None))
    if not isinstance(at, int) or isinstance(at, bool):
        print(f"annot plan: error: --fit {args.fit}: give it as an integer in --kwargs/--config "
              f"(the value to start from), e.g. --kwargs '{{\"{args.fit}\": 32}}'", file=sys.stderr)
        return 2
    try:
        answers = largest_fit(
            lambda v: build_target(args.target, {**options, args.fit: v}, dtype=args.dtype), at,
            inputs=model_inputs(media_sizes(args)),
            keys=[k.strip() for k in args.fit_strategies.split(",") if k.strip()],
            plan_of=plan_of, gpus=args.gpus, nodes=args.nodes, batch=args.batch,
            seq=args.seq or default_seq(model),
            precision=args.precision, optimizer=args.optimizer,
            gpu_mem=gpu_mem if gpu_mem is not None else gpu_kind(args.gpu).memory,
            host_mem=host_mem if host_mem is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            margin=MARGIN if args.margin is None else args.margin,
            reserve=RESERVE if reserve is None else reserve)
    except AnnotError as exc:
        print(f"annot plan: error: {exc}", file=sys.stderr)
        return 2
    print(format_fit(answers, args.fit))
    return 0


DEFAULT_SEQ = 2048
# Config fields that bound a model's sequence length (learned position tables).
_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "n_ctx")


DEFAULT_PRECISION = "bf16-mixed"
#: What ``annot plan --memory`` plans a model with when it fails with 16-bit parameters
#: and --precision was not given (xLSTM: its chunked kernel multiplies fp32 gates by
#: 16-bit values, which torch refuses; under autocast it runs).
FALLBACK_PRECISION = "amp"
_SIXTEEN_BIT = ("bf16-mixed", "fp16-mixed", "bf16")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def fails_in_16_bit(exc: BaseException, precision: str) -> bool:
    """Whether ``exc``, from a trace with 16-bit parameters (``precision``), is a dtype
    mismatch inside the model (fp32 and bf16 operands of one operation)."""
    text = str(exc).lower()
    return (precision in _SIXTEEN_BIT and isinstance(exc, RuntimeError)
            and ("dtype" in text or "scalar type" in text))


#: Said where a model's forward reads a value the memory trace cannot know (the sweeps
#: count it a refusal by name).
CANNOT_TRACE_VALUES = "which the --memory trace cannot know"


def trace_failure(model, exc: Exception, precision: str = "fp32") -> str:
    """The message for a model whose forward failed under the memory trace's fake tensors:
    where it reads a tensor's value (``.item()``, a nonzero's size) the trace cannot know
    it, and the message says so rather than leave a torch internal to decode; a dtype
    error under a 16-bit ``precision`` names the setting (the trace casts parameters as
    mixed precision computes, and some models fail so for real: xLSTM)."""
    from annot.memory.routing_values import reads_values

    name = type(model).__name__
    first = _first_line(exc)
    if reads_values(exc):
        return (f"{name}.forward reads a tensor's value ({first}: e.g. .item() or a size "
                f"that depends on the data), {CANNOT_TRACE_VALUES}: it traces "
                "shapes, not values. annot plan without --memory works, and so does training; "
                "measure this model's peak in a real step instead")
    message = f"tracing {name}.forward for --memory failed: {type(exc).__name__}: {first}"
    if fails_in_16_bit(exc, precision):
        message += (f" (--precision {precision} traces the forward with 16-bit parameters, as "
                    "FSDP's and DeepSpeed's mixed precision run it; a model that fails so outside "
                    "the trace too, as xLSTM does, trains in fp32 or under autocast: plan it with "
                    "--precision fp32 or amp)")
    return message


def default_seq(model) -> int:
    """``--seq`` when not given: 2048, or the model's longest sequence if its config
    bounds it lower (BERT's 512 positions: a longer trace fails inside the model)."""
    config = getattr(model, "config", None)
    limits = [v for v in (getattr(config, name, None) for name in _POSITION_LIMITS)
              if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min([DEFAULT_SEQ, *limits])


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _size(text: str | None, option: str) -> int | None:
    """``"80GiB"`` -> bytes. G/GiB are powers of two, GB powers of ten."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{option}: not a size: {text!r} (try 80GiB, 40G or 8e10)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

