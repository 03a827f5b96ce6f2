"""The built-in known findings (conformance/runner/known_findings.json) label their own failures and nothing else.

Each registration is fed the real reasons of the failures its write-up describes (as recorded in the published
run, docs/results/cpu.json, or a run of the row, or, where marked, built from the case's own message format) and
must label them; every row it names is then fed failures of other causes (a crash, a mismatch of another kind,
an error at another operation), which no registration may label.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conformance.contract.rows import RENAMED_ROWS
from conformance.runner.findings import BUILTIN_FILE, ENV_VAR, Finding, annotate, explaining, load_file

pytestmark = pytest.mark.first_torch  # the suite's own plumbing: [Note: tests on the first torch]

F = "docs/findings/"
FSDP1, FSDP2, FAIRSCALE, TITAN = "torch-fsdp1", "torch-fsdp2", "fairscale-fsdp", "torchtitan-simple-fsdp"
ZERO3 = "deepspeed-zero3"
SYNC = ("rank 0 raised ValueError: The module has CPU parameters or buffers when `sync_module_states=True`, which "
        "requires them to be on GPU. Please specify the `device_id` argument or move the module to GPU before passing "
        "it to FSDP. (world_size=2, mode=process)")
ACCEL = ("rank 0 raised RuntimeError: Cannot access accelerator device when none is available. "
         "(world_size=2, mode=process)")
NOT_CLOSE = "Tensor-likes are not close! |  | Mismatched elements: 4 / 4 (100.0%)"
SHADOW = "rank 0 raised AssertionError: {impl} differs from the shadow model: op {op}, rank 0: {what}"
NARROWED = ("linalg.vector_norm: the dtype of the input (Double) should be convertible without narrowing to the "
            "specified dtype (Float)")
STATEFUL = "rank 0 raised AssertionError: stateful fuzzer (seed 0{under}): op {op}, rank 0: {what}"
POLICY = (", policy=Policy(param_dtype='bfloat16', reduce_dtype='float32', buffer_dtype=None, cast_inputs=False, "
          "keep_low_precision_grads=False)")
NEIGHBOUR = "rank 0 raised AssertionError: stateful fuzzer (seed 0{under}): neighbour ({name}): {what}"
NO_SYNC_MEAN = ("with param_dtype=bfloat16 and reduce_dtype=float32, a backward inside no_sync() and the next one left "
                "a gradient other than the mean over ranks of each rank's sum kept in bfloat16 (no_sync() accumulates "
                "in the parameters the backward computes with; reduce_dtype is the reduction's only): "
                "Tensor-likes are not close!")
GRADS_2X = ("gradients are 2 x expected: the implementation sums where the contract averages "
            "(the mean over ranks, as DDP)")
CUDA_KEY = "rank 0 raised KeyError: 'all_gather' (world_size=2, mode=process)"


def _fsdp1() -> list[tuple[str, str, str, str]]:
    """(impl, row, write-up, real reason) for torch-fsdp1's non-fuzz rows."""
    off, hybrid = F + "fsdp1-cpu-offload-pinning.md", F + "fsdp1-hybrid-cpu.md"
    sync = F + "fsdp1-sync-module-states-cpu.md"
    return [
        (FSDP1, "construction/same_model_across_ranks[use_orig_params=True]", sync, SYNC),
        (FSDP1, "placement/cpu_init_with_sync_module_states[on=cpu]", sync, SYNC),
        (FSDP1, "hybrid_shard/sync_module_states[strategy=HYBRID_SHARD]", sync, SYNC),
        (FSDP1, "overlap/training_overlap", F + "overlap-cpu-torch.md",
         "rank 0 raised AssertionError: rank 0: forward does not overlap: forward 1697 ms (bound 1392), "
         "forward+backward 5091 ms (bound 4176), efficiency 0.80"),
        (FSDP1, "hybrid_shard/basic_setup[strategy=HYBRID_SHARD,mode=ALL_HYBRID,use_device_mesh=False]", hybrid,
         "rank 0 raised AssertionError: use_orig_params=True: ALL_HYBRID: units ['', 'transformer.encoder.layers.0'] "
         "are not hybrid (no replicate group; shard groups [[0], [0]]) (world_size=4, mode=process)"),
        (FSDP1, "hybrid_shard/basic_setup[strategy=HYBRID_SHARD,mode=MIXED_HYBRID_FULL,use_device_mesh=False]", hybrid,
         "rank 0 raised AssertionError: use_orig_params=True: FULL_SHARD unit 'transformer' shards over [0], expected "
         "the world [0, 1, 2, 3] (world_size=4, mode=thread)"),
        (FSDP1, "checkpoint/basic_checkpoint_end_to_end[offload_activations=False,cpu_offload=True]", off, ACCEL),
        (FSDP1, "checkpoint/checkpoint_fsdp_wrapping[nesting=roots,offload_activations=True,cpu_offload=True]", off,
         ACCEL),
        (FSDP1, "placement/device_id_cpu_offload[use_orig_params=False,on=cpu]", off, ACCEL),
        (FSDP1, "grad_accumulation/accumulate[cpu_offload=True,set_to_none=False,no_sync=True]", off, ACCEL),
        (FSDP1, "uneven_shared/train[tie=across_units]", F + "tied-weights-across-units.md",
         "rank 0 raised RuntimeError: 'weight' must be 2-D (world_size=2, mode=thread)"),
        (FSDP1, "state_dict/roundtrip[kind=FULL]", F + "fsdp1-full-optim-state-orig-params.md",
         "rank 0 raised AssertionError: rank 0: losses after FULL load vs the local model[1]: Scalars are not close!"),
        (FSDP1, "state_dict/cross_impl[dst=reference]", F + "fsdp1-full-optim-state-orig-params.md",
         "rank 0 raised AssertionError: rank 0: losses after torch-fsdp1 -> reference vs the local model[1]: "
         "Scalars are not close!"),
        (FSDP1, "mixed_precision/keep_low_precision_grads[strategy=FULL_SHARD]",
         F + "fsdp1-keep-low-precision-grads.md",
         "rank 0 raised AssertionError: step 0: unit 'lin1' grads in {torch.bfloat16}, expected torch.float32"),
        (FSDP1, "mixed_precision/keep_low_precision_grads[reduce_dtype=None,strategy=FULL_SHARD]",
         F + "fsdp1-keep-low-precision-grads.md", "rank 0 raised RuntimeError: attempting to assign a gradient with "
         "dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'. The gradient must match the tensor's grad_dtype "
         "(defaults to the tensor's dtype)."),
        (FSDP1, "hybrid_meshes/replicas_match_baseline[shape=1x4,given=groups,strategy=HYBRID_SHARD]",
         F + "fsdp1-hybrid-shard-group-of-one.md",
         f"rank 0 raised AssertionError: rank 0 1x4 (groups, HYBRID_SHARD) step 0: full params vs baseline"
         f"[body.0.weight]: {NOT_CLOSE}"),
        (FSDP1, "legacy_state_dicts/rekey[key_type=PARAM_ID]", F + "fsdp1-full-optim-state-shared-step.md",
         "rank 0 raised AssertionError: rank 0: losses of a local model loading the re-keyed state[1]: Scalars are "
         "not close!"),
        (FSDP1, "legacy_state_dicts/settings[kind=FULL]", F + "fsdp1-offload-to-cpu-on-cpu.md",
         "rank 0 raised RuntimeError: setStorage: sizes [100], strides [1], storage offset 0, and itemsize 4 "
         "requiring a storage size of 400 are out of bounds for storage of size 0 (world_size=2, mode=process)"),
        (FSDP1, "mixed_precision/buffer_dtype_state_dict[units=nested]",
         F + "fsdp1-buffer-dtype-saved-without-root-params.md",
         "rank 0 raised AssertionError: full state dict dtypes {'scale': torch.bfloat16, 'lin1.weight': torch.float32, "
         "'lin1.bias': torch.float32, 'lin2.weight': torch.float32, 'lin2.bias': torch.float32}, expected the built "
         "ones (world_size=2, mode=process)"),
        (FSDP1, "memory/dropped_model_freed[units=root,last=forward,api=wrap]",
         F + "fsdp1-abandoned-forward-keeps-model.md",
         "rank 0 raised AssertionError: rank 0: the wrap model, dropped by its user after two training steps and a "
         "forward with no backward, is still alive after gc.collect(), a LinearStack (held by objects of types "
         "['dict']): its parameters, gradients and process groups are never freed (world_size=2, mode=thread)"),
    ]


def _fsdp1_fuzz() -> list[tuple[str, str, str, str]]:
    """(impl, row, write-up, real reason) for torch-fsdp1's fuzz rows; neighbour and memory reasons are built from
    the fuzzer's message formats (conformance/fuzz/option_neighbours.py, held.py)."""
    unused, reentrant = F + "fsdp1-no-shard-unused-unit-params.md", F + "fsdp1-reentrant-checkpoint-frees-unit.md"
    shadow = SHADOW.format(impl=FSDP1, op="{op}", what="{what}")
    return [
        (FSDP1, "fuzz/repro_no_shard_unused_unit_params", unused,
         "rank 0 raised AssertionError: torch-fsdp1 differs from the local "
         "baseline: step 0, rank 0: parameters registered after backward: the wrapped model has 6 parameters, "
         "the local model 8 (world_size=1, mode=process)"),
        (FSDP1, "fuzz/parity_ws1", unused, "rank 0 raised AssertionError: parity fuzzer (seed 0): step 0, rank 0: "
         "parameters registered after backward: the wrapped model has 6 parameters, the local model 4"),
        (FSDP1, "fuzz/stateful_ws1", unused, STATEFUL.format(
            under="", op="1 (Backward())", what="parameters registered: the wrapped model has 6, the shadow 4")),
        (FSDP1, "fuzz/repro_summon_grads_float64_padding_shard", F + "fsdp1-summon-grads-float64-padding-shard.md",
         "rank 0 timed out: no result after 90 s"),
        (FSDP1, "fuzz/repro_no_shard_low_precision_accumulation", F + "fsdp1-no-shard-low-precision-accumulation.md",
         "rank 0 raised AssertionError: torch-fsdp1 differs from the local baseline: step 0, rank 0: params after "
         "step: "
         f"params[blocks.0.layers.0.weight]: {NOT_CLOSE}"),
        (FSDP1, "fuzz/repro_buffer_dtype_state_dict_before_forward", F + "fsdp1-buffer-dtype-rounds-saved-buffers.md",
         shadow.format(
            op="0 (Save(sharded=False, optim=False))",
            what=f"full model state dict: state_dict[blocks.0.layers.0.scale]: {NOT_CLOSE}")),
        (FSDP1, "fuzz/stateful_ws2", F + "fsdp1-flat-parameter-keeps-modules.md", STATEFUL.format(
            under="", op="3 (End())", what="memory held: the wrapped model, dropped at the program's end, is still "
            "alive after gc.collect(), a Linear (held by objects of types ['ParamInfo']): nothing frees its "
            "parameters, gradients or process groups")),
        (FSDP1, "fuzz/stateful_ws2", F + "fsdp1-flat-parameter-keeps-modules.md", STATEFUL.format(
            under="", op="1 (End())", what="memory held: the wrapped model, dropped at the program's end, is still "
            "alive after gc.collect(), a Linear (held by objects of types ['ParamInfo', 'set']): nothing frees its "
            "parameters, gradients or process groups")),
        (FSDP1, "fuzz/stateful_ws2", F + "fsdp1-buffer-dtype-rounds-saved-buffers.md", STATEFUL.format(
            under=", policy=Policy(param_dtype='float16', reduce_dtype='float32', buffer_dtype='float16', "
            "cast_inputs=False, keep_low_precision_grads=False)", op="0 (Save(sharded=True, optim=False))",
            what=f"buffers: buffers[blocks.1.layers.0.scale]: {NOT_CLOSE}")),
        (FSDP1, "fuzz/stateful_ws4", reentrant, "rank 0 raised AssertionError: stateful fuzzer (seed 0): after its "
         "operations, rank 0: neighbour (keeping form): RuntimeError: weight should have at least three dimensions"),
        (FSDP1, "fuzz/stateful_ws2", F + "fsdp1-keep-low-precision-grads.md", STATEFUL.format(
            under=", policy=Policy(param_dtype='bfloat16', reduce_dtype=None, buffer_dtype=None, cast_inputs=False, "
            "keep_low_precision_grads=True)", op="0 (Train(batch=0))", what="raised: RuntimeError: attempting to "
            "assign a gradient with dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'. The gradient must "
            "match the tensor's grad_dtype (defaults to the tensor's dtype).")),
        (FSDP1, "fuzz/stateful_ws2", F + "fsdp1-abandoned-forward-keeps-model.md", STATEFUL.format(
            under="", op="1 (End())", what="memory held: the wrapped model, dropped at the program's end, is still "
            "alive after gc.collect(), a FullyShardedDataParallel (held by objects of types ['list', 'tuple']): "
            "nothing frees its parameters, gradients or process groups")),
        (FSDP1, "fuzz/repro_no_grad_forward_before_step", F + "fsdp1-no-grad-forward-before-step-stale-params.md",
         shadow.format(
            op="3 (Step())", what=f"params: params[blocks.0.layers.0.weight]: {NOT_CLOSE}")),
        (FSDP1, "fuzz/repro_reentrant_checkpoint_root_params", reentrant, shadow.format(
            op="0 (Train(batch=0))", what="raised: RuntimeError: setStorage: sizes [2, 2], strides [2, 1], storage "
            "offset 14, and itemsize 4 requiring a storage size of 72 are out of bounds for storage of size 0")),
        (FSDP1, "fuzz/stateful_ws2", reentrant, STATEFUL.format(
            under=", policy=Policy(param_dtype='float16', reduce_dtype='float32', buffer_dtype=None, "
            "cast_inputs=False, keep_low_precision_grads=False)", op="0 (Train(batch=0))",
            what="raised: RuntimeError: mat1 and mat2 must have the same dtype, but got Half and Float")),
        (FSDP1, "fuzz/stateful_ws4", reentrant, STATEFUL.format(
            under="", op="2 (Backward())", what="raised: RuntimeError: setStorage: sizes [3, 3], strides [3, 1], "
            "storage offset 0, and itemsize 4 requiring a storage size of 36 are out of bounds for storage of size 0")),
        (FSDP1, "fuzz/stateful_ws2", F + "tied-weights-across-units.md", NEIGHBOUR.format(
            under="", name="tied across units", what="AssertionError: a weight tied across two units was accepted "
            "and trained as two parameters: after a step blocks.0.weight and blocks.1.weight differ by up to 0.373")),
        (FSDP1, "fuzz/stateful_ws2", F + "fsdp1-sync-module-states-cpu.md", NEIGHBOUR.format(
            under="", name="sync_module_states", what=SYNC.split("raised ", 1)[1].rsplit(" (world_size", 1)[0])),
        (FSDP1, "fuzz/stateful_ws2", F + "fsdp1-summon-grads-float64-padding-shard.md", STATEFUL.format(
            under="", op="1 (Train(batch=0))", what="raised: RuntimeError: summon_full_params(with_grads=True) would "
            "abort the process: a sharded FlatParameter has a gradient of dtype ['torch.float64'] on some ranks and "
            "none on others, which FSDP1 all-gathers as zeros of the default dtype torch.float32 (gloo: Received data "
            "size doesn't match expected size)")),
        (FSDP1, "fuzz/stateful_ws1", F + "fsdp1-cpu-offload-pinning.md", STATEFUL.format(
            under="", op="0 (Train(batch=0))", what="raised: RuntimeError: Cannot access accelerator device when none "
            "is available.")),
        (FSDP1, "fuzz/stateful_ws1", F + "fsdp1-cpu-offload-pinning.md", STATEFUL.format(  # a CUDA build, no driver
            under="", op="0 (Train(batch=0))", what="raised: RuntimeError: Found no NVIDIA driver on your system. "
            "Please check that you have an NVIDIA GPU and installed a driver from "
            "http://www.nvidia.com/Download/index.aspx")),
        (FSDP1, "fuzz/stateful_ws2", F + "fsdp1-summon-offload-to-cpu-on-cpu.md", STATEFUL.format(
            under="", op="0 (SummonFull(unit='', recurse=True, rank0_only=False, offload_to_cpu=True, "
            "with_grads=False))", what="raised: RuntimeError: summon_full_params(offload_to_cpu=True) would read freed "
            "memory: FSDP1 (torch < 2.14) frees the gathered parameters of a model computing on the CPU when it "
            "offloads them there (pytorch/pytorch#188989)")),
        (FSDP1, "fuzz/stateful_ws4", F + "fsdp1-summon-offload-to-cpu-on-cpu.md", STATEFUL.format(  # flat parameters
            under="", op="3 (SummonFull(unit='blocks.0', recurse=False, rank0_only=True, offload_to_cpu=True, "
            "with_grads=False))", what="raised: RuntimeError: setStorage: sizes [16], strides [1], storage offset 0, "
            "and itemsize 4 requiring a storage size of 64 are out of bounds for storage of size 0")),
        (FSDP1, "grad_clip/wrapper_clip_grad_norm_float64", F + "fsdp1-clip-grad-norm-float64.md",
         f"rank 0 raised RuntimeError: {NARROWED}"),
        (FSDP1, "fuzz/repro_clip_grad_norm_float64", F + "fsdp1-clip-grad-norm-float64.md", shadow.format(
            op="2 (ClipGradNorm(max_norm=0.01, norm_type=2.0))", what=f"raised: RuntimeError: {NARROWED}")),
    ]


def _fsdp2() -> list[tuple[str, str, str, str]]:
    """(impl, row, write-up, real reason) for torch-fsdp2; the stateful rows' reasons are built from the fuzzer's
    message format (conformance/cases/test_fuzz.py), the GPU row's from the case's assertion."""
    nosync, nograd = F + "fsdp2-no-sync-accumulates-in-reduce-dtype.md", F + "fsdp2-no-grad-forward-unsharded-params.md"
    dcp_load = F + "dcp-full-optim-load-with-grads-before-first-step.md"
    dcp_adam = F + "dcp-optim-state-dict-steps-adam.md"
    shadow = SHADOW.format(impl=FSDP2, op="{op}", what="{what}")
    no_grad_fwd = "2 (Forward(batch=0, grad=False, loss='all'))"
    return [
        (FSDP2, "fully_shard_api/reset_iter_state[when=backward]",
         F + "fsdp2-reset-iter-state-after-backward-failure-root-params.md",
         "rank 0 raised AssertionError: rank 0: after a failed backward[head.weight]: Tensor-likes are not close!"),
        (FSDP2, "overlap/training_overlap", F + "overlap-cpu-torch.md",
         "rank 0 raised AssertionError: rank 0: forward does not overlap: forward 1695 ms (bound 1392), "
         "forward+backward 5084 ms (bound 4176), efficiency 0.80"),
        (FSDP2, "placement/ignored_params_not_moved[on=gpu]", F + "fsdp2-ignored-module-buffers-moved.md",
         "rank 0 raised AssertionError: ignored module's tensors changed: before {1: (device(type='cpu'), 94)}, "
         "after {1: (device(type='cuda', index=0), 140)}"),
        (FSDP2, "fuzz/repro_no_grad_forward_unsharded_params", nograd, shadow.format(
            op=no_grad_fwd, what=f"grads: grads[blocks.0.layers.0.weight]: {NOT_CLOSE}")),
        (FSDP2, "fuzz/stateful_ws2", nograd, STATEFUL.format(
            under="", op=no_grad_fwd, what=f"grads: grads[blocks.0.layers.0.weight]: {NOT_CLOSE}")),
        (FSDP2, "fuzz/repro_full_optim_load_before_first_step", dcp_load, shadow.format(
            op="3 (Load())", what="raised: AssertionError: Expected device to be set")),
        (FSDP2, "fuzz/stateful_ws4", dcp_load, STATEFUL.format(
            under="", op="3 (Load())", what="raised: AssertionError: Expected device to be set")),
        (FSDP2, "fuzz/repro_no_sync_float32_reduce_accumulation", nosync, shadow.format(
            op="0 (NoSync(batch=0))", what=f"grads: grads[blocks.1.layers.0.weight]: {NOT_CLOSE}")),
        (FSDP2, "fuzz/stateful_ws1", nosync, STATEFUL.format(
            under=POLICY, op="0 (NoSync(batch=0))", what=f"grads: grads[blocks.1.layers.0.weight]: {NOT_CLOSE}")),
        (FSDP2, "fuzz/stateful_ws2", nosync, NEIGHBOUR.format(
            under=POLICY, name="unsynced sums", what=f"AssertionError: {NO_SYNC_MEAN}")),
        (FSDP2, "mixed_precision/unsynced_sums[api=wrap,param_dtype=bfloat16]", nosync,
         f"rank 0 raised AssertionError: {NO_SYNC_MEAN}"),
        (FSDP2, "fuzz/stateful_ws2", F + "fsdp2-optim-load-refuses-params-without-state.md", STATEFUL.format(
            under="", op="4 (Load())", what="raised: RuntimeError: Missing optimizer state for parameter "
            "'unused.weight' in checkpoint. The parameter requires gradients but has no saved optimizer state.")),
        (FSDP2, "fuzz/repro_optim_state_dict_before_first_step_adam", dcp_adam, shadow.format(
            op="1 (Train(batch=0))", what=f"params: params[blocks.0.layers.0.weight]: {NOT_CLOSE}")),
        (FSDP2, "fuzz/repro_divide_factor_one_rank", F + "fsdp2-divide-factor-twice-at-one-rank.md", SHADOW.format(
            impl=FSDP2, op="1 (Train(batch=0))", what=f"params: params[blocks.0.layers.0.weight]: {NOT_CLOSE}")
         + " (world_size=1, mode=thread)"),
        (FSDP2, "fuzz/stateful_ws4", dcp_adam, STATEFUL.format(
            under="", op="1 (Train(batch=0))", what=f"params: params[embed.weight]: {NOT_CLOSE}")),
        (FSDP2, "fuzz/stateful_ws1", dcp_adam, STATEFUL.format(
            under="", op="1 (Train(batch=0))", what=f"params: params[embed.weight]: {NOT_CLOSE}")),
        (FSDP2, "fuzz/stateful_ws1", dcp_adam, STATEFUL.format(
            under="", op="1 (Train(batch=1))", what=f"params: params[blocks.0.layers.0.weight]: {NOT_CLOSE}")),
        (FSDP2, "fuzz/stateful_ws2", dcp_adam, STATEFUL.format(
            under="", op="1 (Train(batch=1))", what=f"params: params[embed.weight]: {NOT_CLOSE}")),
        (FSDP2, "fuzz/stateful_ws1", nograd, STATEFUL.format(
            under="", op="3 (Forward(batch=0, grad=False, loss='all'))",
            what=f"grads: grads[blocks.0.layers.0.weight]: {NOT_CLOSE}")),
        (FSDP2, "fuzz/stateful_ws1", nograd, STATEFUL.format(
            under="", op="2 (Load())", what="raised: RuntimeError: Error(s) in loading state_dict for FSDPFuzzModel: "
            "| \tWhile copying the parameter named \"head.bias\", whose dimensions in the model are torch.Size([2]) "
            "and whose dimensions in the checkpoint are torch.Size([2]), an exception occurred : ('aten.copy_.default "
            "got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor before calling "
            "distributed operators!',).")),
    ]


def _others() -> list[tuple[str, str, str, str]]:
    """(impl, row, write-up, real reason) for the optional columns, from docs/results/cpu.json."""
    cuda, sums, eager = F + "fairscale-fsdp-needs-cuda.md", F + "titan-simple-fsdp-sums-gradients.md", \
        F + "titan-simple-fsdp-eager-mode.md"
    untie = F + "titan-simple-fsdp-unties-shared-parameters.md"
    fairscale = [(FAIRSCALE, row, cuda, CUDA_KEY) for row in (
        "checkpoint/basic_checkpoint_end_to_end", "grad_accumulation/accumulate", "placement/no_params",
        "training/cpu_training_parity_vs_ddp", "training/module_no_compute_grad", "overlap/training_overlap",
        "unit_outputs/caller_use[use=view]", "memory/peak_per_rank[use_orig_params=True]",
        "user_hooks/module_hooks[api=wrap]")]
    fairscale += [
        (FAIRSCALE, "uneven_shared/train[tie=within_unit]", cuda,
         "rank 0 raised AssertionError: use_orig_params=True: Torch not compiled with CUDA enabled"),
        (FAIRSCALE, "fuzz/stateful_ws1", cuda, STATEFUL.format(
            under="", op="0 (Train(batch=0))", what="raised: KeyError: 'all_gather'")),
    ]
    zero3 = [(ZERO3, "memory/dropped_model_freed[units=root,last=step,api=wrap]",
              F + "deepspeed-zero3-destroy-keeps-model.md",
              "rank 0 raised AssertionError: rank 0: the wrap model, dropped by its user after two training steps, "
              "is still alive after gc.collect(), a LinearStack (held by objects of types ['DeepSpeedZeRoOffload', "
              "'Init', 'cell', 'dict', 'list', 'method', 'tuple']): its parameters, gradients and process groups are "
              "never freed (world_size=2, mode=process)"),
             (ZERO3, "placement/no_params[use_device_id=False]", F + "deepspeed-zero3-no-params-indexerror.md",
              "rank 0 raised IndexError: list index out of range (world_size=2, mode=process)")]
    stale, bucket = F + "deepspeed-zero3-stale-gradient-outside-loss.md", F + "deepspeed-zero3-reduce-bucket.md"
    zero3 += [
        (ZERO3, "unit_outputs/not_all_outputs_used_in_loss[strategy=FULL_SHARD]", stale,
         f"rank 0 raised AssertionError: params after step 2 on rank 0[lin2.weight]: {NOT_CLOSE}"),
        (ZERO3, "training/module_no_compute_grad[strategy=None,use_second_layer=True]", stale,
         "rank 0 raised AssertionError: step 0, rank 0: unit 'b' grad present [True, True], expected all False "
         "(world_size=2, mode=process)"),
        (ZERO3, "grad_accumulation/accumulate[cpu_offload=False,set_to_none=True,no_sync=False]", stale,
         "rank 0 raised AssertionError: rank 0: zero_grad(set_to_none=True) left grads on ['lin1.weight', "
         "'lin1.bias'] (world_size=2, mode=process)"),
        (ZERO3, "memory/peak_per_rank[use_orig_params=False]", bucket,
         "rank 0 raised AssertionError: rank 0: peak 2001056777 B during a step exceeds the bound 491520 B by "
         "2000565257 B (sharded parameters+gradients+state 393216 B, 5 units of 16384 B, activations 16384 B) "
         "(world_size=2, mode=process)"),
        *((f"deepspeed-zero{stage}", "fuzz/parity_ws2", F + "deepspeed-zero-float64-trains-in-float32.md",
           "rank 0 raised AssertionError: parity fuzzer (seed 0): step 0, rank 0: grads after backward: "
           "grads[blocks.0.layers.0.weight]: The values for attribute 'dtype' do not match: torch.float32 != "
           "torch.float64.") for stage in (1, 2, 3)),
        *((f"deepspeed-zero{stage}", "fuzz/stateful_ws1", F + "deepspeed-zero-step-without-backward.md",
           STATEFUL.format(under="", op="0 (Step())", what="raised: KeyError: 0")) for stage in (1, 2, 3)),
        *((ZERO3, row, F + "deepspeed-zero3-prefetch-keeps-gathered.md", "rank 0 raised AssertionError: rank 0 step 1 "
           f"with {what}: after forward, units ['head.a', 'head.b'] still hold their unsharded parameters "
           "(world_size=2, mode=process)") for row, what in (
            ("unit_outputs/caller_use[use=view]", "the head output used as 'view'"),
            ("unit_outputs/structured_outputs[structure=dict]", "head's outputs in a dict"))),
        (ZERO3, "fuzz/stateful_ws4", F + "deepspeed-zero3-destroy-keeps-model.md", "rank 0 raised AssertionError: "
         "stateful fuzzer (seed 0): rank 0: memory held: the wrapped model, dropped at the program's end, is still "
         "alive after gc.collect(), a DeepSpeedEngine (held by objects of types ['cell', 'method']): nothing frees "
         "its parameters, gradients or process groups"),
        (ZERO3, "fuzz/stateful_ws1", bucket, STATEFUL.format(
            under="", op="0 (NoSync(batch=0))", what="memory held: since wrapping this rank holds 2000000145 B, "
            "more than 224 B: 224 B of sharded parameters")),
        (ZERO3, "fuzz/stateful_ws2", bucket, STATEFUL.format(
            under="", op="0 (Train(batch=0))", what="memory held: since a synchronising backward this rank holds "
            "2000000105 B, more than 168 B: 56 B of sharded parameters")),
    ]
    return fairscale + zero3 + [
        (TITAN, "training/cpu_training_parity_vs_ddp[strategy=FULL_SHARD,optim=SGD]", sums,
         "rank 0 raised AssertionError: torchtitan-simple-fsdp vs ddp at step 1: loss: Scalars are not close!"),
        (TITAN, "grad_accumulation/accumulate", sums, "rank 0 raised AssertionError: rank 0 step 0: grads after 3 "
         f"backwards vs the local model[lin1.weight]: {GRADS_2X}"),
        (TITAN, "hybrid_meshes/replicas_match_baseline[shape=2x2,given=mesh,strategy=HYBRID_SHARD]", sums,
         f"rank 0 raised AssertionError: rank 0 2x2 (mesh, HYBRID_SHARD) step 0: full params vs baseline"
         f"[body.0.weight]: {NOT_CLOSE}"),
        (TITAN, "mixed_precision/param_and_reduce_dtypes", sums,
         f"rank 0 raised AssertionError: step 0 grads[lin1.weight]: {GRADS_2X}"),
        (TITAN, "state_dict/load_in_loop[point=after_forward]", sums, "rank 0 raised AssertionError: "
         "use_orig_params=True: rank 0: losses after loading after_forward vs the loaded model trained locally[1]: "
         "Scalars are not close!"),
        (TITAN, "state_dict/cross_impl[dst=torch-fsdp1]", sums, "rank 0 raised AssertionError: rank 0: losses after "
         "torchtitan-simple-fsdp -> torch-fsdp1 vs the local model[1]: Scalars are not close!"),
        (TITAN, "unit_outputs/not_all_outputs_used_in_loss[strategy=NO_SHARD]", sums,
         f"rank 0 raised AssertionError: params after step 0 on rank 0[lin1.weight]: {NOT_CLOSE}"),
        (TITAN, "unit_outputs/root_outputs", sums,
         f"rank 0 raised AssertionError: rank 0 step 0: grads[a.weight]: {GRADS_2X}"),
        (TITAN, "user_hooks/module_hooks[api=wrap]", sums,
         "rank 0 raised AssertionError: rank 0: output of step 1[output]: Tensor-likes are not close!"),
        (TITAN, "fuzz/parity_ws4", sums, "rank 0 raised AssertionError: parity fuzzer (seed 0): step 0, rank 0: grads "
         f"after backward: grads[blocks.0.layers.0.weight]: {GRADS_2X.replace('2 x', '4 x')}"),
        (TITAN, "uneven_shared/train[tie=within_unit]", untie, "rank 0 raised AssertionError: use_orig_params=True: "
         "rank 0: params after wrap: names differ; missing=[] unexpected=['proj.weight']"),
        (TITAN, "fuzz/parity_ws1", untie, "rank 0 raised AssertionError: parity fuzzer (seed 0): step 0, rank 0: grads "
         "after backward: grads: names differ; missing=[] unexpected=['blocks.0.layers.1.weight']"),
        (TITAN, "hybrid_shard/basic_setup[strategy=HYBRID_SHARD]", eager, "rank 0 raised AssertionError: "
         "use_orig_params=True: rank 0 HYBRID_SHARD (32 hybrid units, 32 non-root; 2 FULL_SHARD): backward "
         "all-gathers over the shard group (non-root units were freed): 0 < 32"),
        (TITAN, "unit_outputs/caller_use[use=view]", eager, "rank 0 raised AssertionError: rank 0 step 0: no "
         "all-gather in backward with head's outputs in a view; head was resharded after forward, so its "
         "backward must gather it"),
        (TITAN, "unit_outputs/structured_outputs[structure=dict]", eager, "rank 0 raised AssertionError: rank 0 "
         "step 0: no all-gather in backward with head's outputs in a dict; head was resharded after forward, so "
         "its backward must gather it again"),
        (TITAN, "memory/peak_per_rank[use_orig_params=True]", eager, "rank 0 raised AssertionError: rank 0: peak "
         "533008 B during a step exceeds the bound 491520 B by 41488 B (sharded parameters+gradients+state "
         "393216 B, 5 units of 16384 B, activations 16384 B) (world_size=2, mode=process)"),
        (TITAN, "overlap/training_overlap", eager, "rank 0 raised AssertionError: rank 0: forward does not overlap: "
         "forward 1702 ms (bound 1392)"),
        (TITAN, "fuzz/stateful_ws1", F + "titan-simple-fsdp-trains-frozen-parameters.md", STATEFUL.format(
            under="", op="0 (Train(batch=0))", what=f"params: params[blocks.1.layers.0.weight]: {NOT_CLOSE}")),
        (TITAN, "fuzz/stateful_ws1", F + "dcp-optim-state-dict-steps-adam.md", STATEFUL.format(
            under="", op="1 (Train(batch=0))", what=f"params: params[embed.weight]: {NOT_CLOSE}")),
    ]


def _others_fuzz() -> list[tuple[str, str, str, str]]:
    """(impl, row, write-up, real reason) for the optional columns' fuzz and neutrality rows, from
    docs/results/cpu.json."""
    sums, eager = F + "titan-simple-fsdp-sums-gradients.md", F + "titan-simple-fsdp-eager-mode.md"
    unprefetched = ("all-gathers in backward: backward issued reduce-scatter, reduce-scatter, all-gather, all-gather, "
                    "{more}: the second all-gather only after the first reduce-scatter, so nothing was prefetched "
                    "(backward prefetch is the default)")
    on_two = " (world_size=2, mode=process)"
    return [
        (FAIRSCALE, "neutrality/knob[knob=forward_prefetch]", F + "fairscale-fsdp-needs-cuda.md",
         CUDA_KEY),
        (TITAN, "fuzz/stateful_ws1", F + "titan-simple-fsdp-unties-shared-parameters.md", NEIGHBOUR.format(
            under="", name="tied across units", what="AssertionError: a weight tied across two units was accepted "
            "and trained as two parameters: after a step first.layers.0.weight and second.layers.0.weight differ by "
            "up to 0.0159; the contract: refuse the tie or keep it one parameter")),
        *[(TITAN, row, sums, STATEFUL.format(under="", op="0 (Train(batch=0))",
                                             what=f"params: params[blocks.0.layers.0.weight]: {NOT_CLOSE}"))
          for row in ("fuzz/stateful_ws2", "fuzz/stateful_ws4")],
        (TITAN, "fuzz/stateful_ws2", sums, STATEFUL.format(
            under=POLICY.replace("bfloat16", "float16"), op="0 (Train(batch=0))",
            what=f"params: params[blocks.0.layers.0.weight]: {NOT_CLOSE}")),
        (TITAN, "fuzz/stateful_ws1", F + "titan-simple-fsdp-unties-shared-parameters.md", STATEFUL.format(
            under="", op="0 (Train(batch=0))", what="parameters registered: the wrapped model has 4, the shadow 3")),
        (TITAN, "fuzz/repro_optim_state_dict_before_first_step_adam", F + "dcp-optim-state-dict-steps-adam.md",
         SHADOW.format(impl=TITAN, op="1 (Train(batch=0))",
                       what=f"params: params[blocks.0.layers.0.weight]: {NOT_CLOSE}") + on_two),
        (TITAN, "fuzz/repro_sharded_state_dict_before_recompute", eager, SHADOW.format(
            impl=TITAN, op="2 (Backward())", what=unprefetched.format(more="reduce-scatter, reduce-scatter")) + on_two),
        (TITAN, "fuzz/repro_reentrant_checkpoint_root_params", eager, SHADOW.format(
            impl=TITAN, op="0 (Train(batch=0))", what=unprefetched.format(more=", ".join(["reduce-scatter"] * 5)))
         + on_two),
    ]


#: (impl, row, the write-up that explains it, the failure's real reason).
REAL = _fsdp1() + _fsdp1_fuzz() + _fsdp2() + _others() + _others_fuzz()

#: Failures of other causes than any finding's: crashes, mismatches of another kind, errors at other operations.
#: ``{at}`` is where a fuzz row places them.
_UNRELATED_WHAT = (
    "raised: RuntimeError: CUDA error: an illegal memory access was encountered",
    "raised: RuntimeError: unrelated crash",
    "raised: RuntimeError: shape mismatch in load: expected [4, 4], got [2, 4]",
    "grads: names differ; missing=['blocks.0.layers.0.bias'] unexpected=[]",
    "params: params[blocks.0.layers.0.weight]: dtype torch.bfloat16, expected torch.float32",
)
_OPS = ("2 (Forward(batch=0, grad=False, loss='all'))", "0 (NoSync(batch=0))", "3 (Load())", "1 (Train(batch=0))",
        "3 (Step())", "0 (Save(sharded=False, optim=False))", "1 (Backward())")


def unrelated(impl: str, row: str) -> list[str]:
    """Failure reasons of ``row`` on ``impl`` that no finding describes."""
    plain = ["rank 1 died (signal SIGSEGV) (world_size=2, mode=process)",
             "rank 0 raised RuntimeError: CUDA error: an illegal memory access was encountered",
             "rank 0 raised RuntimeError: unrelated crash (world_size=2, mode=thread)",
             "rank 0 raised AssertionError: rank 0: grads differ from the local model[lin1.weight]: names differ; "
             "missing=['lin1.bias'] unexpected=[]",
             "rank 0 raised AssertionError: shape mismatch in load: expected [4, 4], got [2, 4]",
             "rank 0 raised AssertionError: rank 0: buffers moved: {'running_mean': device(type='meta')}"]
    if not row.startswith("fuzz/"):
        return plain
    shadow = [SHADOW.format(impl=impl, op=op, what=what) for op in _OPS for what in _UNRELATED_WHAT]
    stateful = [STATEFUL.format(under=under, op=op, what=what)
                for under in ("", POLICY) for op in _OPS for what in _UNRELATED_WHAT]
    neighbours = [NEIGHBOUR.format(under=POLICY, name=name, what="RuntimeError: unrelated crash")
                  for name in ("unsynced sums", "tied across units", "sync_module_states")]
    return plain + shadow + stateful + neighbours


def _builtin() -> list[Finding]:
    return load_file(BUILTIN_FILE)


def _example_rows(finding: Finding) -> list[tuple[str, str, str]]:
    """The real (row, write-up, reason) examples ``finding`` explains."""
    return [(row, doc, reason) for impl, row, doc, reason in REAL if finding.explains(impl, row, reason)]


@pytest.mark.parametrize("finding", _builtin(), ids=lambda f: f"{f.impl}:{f.rows}:{f.doc.rsplit('/', 1)[-1]}")
def test_each_registration_labels_a_real_failure_of_its_own(finding: Finding) -> None:
    examples = _example_rows(finding)
    assert examples, f"no recorded failure is explained by {finding}; add one to REAL or narrow/remove it"
    assert all(doc == finding.doc for _, doc, _ in examples), (finding, examples)


@pytest.mark.parametrize(("impl", "row", "doc", "reason"), REAL, ids=[f"{i}:{r}:{d[len(F):]}" for i, r, d, _ in REAL])
def test_a_real_failure_is_labelled_with_its_own_write_up(impl: str, row: str, doc: str, reason: str) -> None:
    finding = explaining(impl, row, reason)
    assert finding is not None and finding.doc == doc, (finding, doc)
    assert annotate(impl, row, reason).endswith(f"see {doc}: {reason}")


@pytest.mark.parametrize(("impl", "row"), sorted({(i, r) for i, r, _, _ in REAL}))
def test_no_registration_labels_a_failure_of_another_cause(impl: str, row: str) -> None:
    """Every row a registration names (through its real examples), fed crashes, mismatches of another kind and
    errors at other operations: none is labelled."""
    labelled = [(reason, f.doc) for reason in unrelated(impl, row) if (f := explaining(impl, row, reason))]
    assert not labelled, labelled


@pytest.mark.parametrize(("impl", "row", "reason"), [
    (FSDP2, "fuzz/stateful_ws2", STATEFUL.format(under="", op="2 (Forward(batch=0, grad=False, loss='all'))",
                                                 what="raised: RuntimeError: CUDA error: an illegal memory access "
                                                      "was encountered")),
    (FSDP2, "fuzz/stateful_ws1", STATEFUL.format(under=POLICY, op="0 (NoSync(batch=0))",
                                                 what="raised: RuntimeError: unrelated crash")),
    (FSDP1, "checkpoint/checkpoint_submodule", "rank 0 raised AssertionError: grads differ from the local model"),
    (FSDP1, "state_dict/cross_impl[dst=reference]", "rank 0 raised AssertionError: shape mismatch in load"),
])
def test_failures_of_another_cause_are_not_labelled(impl: str, row: str, reason: str) -> None:
    """Failures of a cause other than the one the write-ups describe, which a looser registration would label."""
    assert explaining(impl, row, reason) is None


def test_a_registration_naming_a_renamed_rows_old_id_applies_to_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: renamed rows]: a package's finding registered under a row's old id (with parameters or not), from a
    file or built as a :class:`Finding`, explains that row's failures under its new id, warning naming it."""
    old, new = "fuzz/repro_8fc450e8", RENAMED_ROWS["fuzz/repro_8fc450e8"]
    listed = tmp_path / "findings.json"
    listed.write_text(json.dumps([{"impl": "my-fsdp", "rows": old, "doc": "d.md"}]))
    monkeypatch.setenv(ENV_VAR, str(listed))
    with pytest.warns(DeprecationWarning, match=re.escape(f"finding for my-fsdp: row id '{old}' is renamed '{new}'")):
        found = explaining("my-fsdp", new, "params differ")
    assert found is not None and found.rows == new and found.doc == "d.md", found
    with pytest.warns(DeprecationWarning, match=re.escape(f"row id '{old}[x=1]' is renamed '{new}[x=1]'")):
        built = Finding("my-fsdp", f"{old}[x=1]", "d.md")
    assert built.explains("my-fsdp", f"{new}[x=1,y=2]", "params differ")
    assert not built.explains("my-fsdp", f"{new}[x=2]", "params differ")
