"""Run one fuzz example on the harness's ranks against a local baseline.

[Note: fuzz verdicts agree across ranks]
A mismatch never raises mid-step: it is kept and the step goes on, so a rank
never leaves the others waiting in the implementation's next collective. After
the wrap and after every step, ranks all-gather their failure text (a kept
mismatch, or an exception from the implementation) and all stop at the first
one, so every rank reaches the same verdict, which the driver
(:mod:`conformance.fuzz.driver`) hands to hypothesis. A check of the
fuzzer's own that raises is kept like a failed assertion. The stateful fuzzer
agrees on each operation before its state check, whose collectives (gathers
of full values) run only once every rank is through the operation: a rank
that raised at the operation's end would otherwise meet its peers' first
gather with its verdict's all-gather in the same process group, collectives
of different sizes that gloo pairs without noticing (measured: the raising
rank read a float as its peer's object size and tried to allocate 4.5e18
bytes, while the peer waited in ``DTensor.full_tensor``). Only an implementation that raises on
some ranks but not others in the middle of its own collectives can still hang
a run; the harness then names the hung rank.

The baseline is the unwrapped model on every rank, fed every rank's batches:
rank ``r``'s loss is compared with the baseline's loss on rank ``r``'s batch,
and the baseline's gradient is the mean over ranks of those losses'
gradients, which is what data-parallel averaging produces. Under a
mixed-precision policy the baseline trains as [Note: fuzz mixed-precision
baseline] in :mod:`conformance.fuzz.precision` says, and every output must come
out in the param dtype. Comparisons are ``torch.testing.assert_close`` with its
defaults for the dtype (through :mod:`fixtures.parity`; under a policy, losses
and gradients in the param dtype, as that note explains). A missing gradient
(``None``) and an all-zero one are treated alike: flat-parameter
implementations cannot tell them apart within a unit, and
``training/module_no_compute_grad`` checks that contract on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from conformance.contract.adapter import FSDPAdapter, UnitInfo, WrapSpec
from conformance.contract.optional import full_grads
from conformance.fuzz.example import Example
from conformance.fuzz.model import build_model, loss_of, make_batch
from conformance.fuzz.precision import (
    as_compared,
    dtype_of,
    in_compute_dtype,
    local_backward,
    low_precision_model,
    mixed_precision_spec,
    model_input,
)
from fixtures.parity import assert_close_named, named_grads

if TYPE_CHECKING:
    from harness import RankContext

__all__ = ["ADAM_EPS", "agree", "fail", "assert_dtypes", "assert_no_grads_outside_the_loss", "assert_optim_state",
           "assert_same_dtypes", "attempt", "check_example", "make_optimizer", "run_example", "unwrapped_name",
           "unwrapped_names",
           "wrap_plan", "zeros_for_none"]

_LR = {"sgd": 0.05, "adam": 0.01}
#: Adam's ``eps``. With torch's 1e-8 a gradient at rounding-noise level (1e-9: a LayerNorm over two
#: features passes back exactly zero in theory, and what flows through it is rounding) takes a step of
#: a tenth of the learning rate, so two correct implementations rounding differently end 2e-5 apart
#: (the reference, torch FSDP1 and FSDP2 alike, at four ranks); at 1e-3 such noise moves a parameter
#: by 1e-8, while real gradients (1e-2 and up) still take Adam's normalised steps.
ADAM_EPS = 1e-3


def assert_same_dtypes(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None]) -> None:
    """Every gradient both sides have is in the same dtype (``keep_low_precision_grads`` leaves them low)."""
    differ = {}
    for name, grad in got.items():
        other = want.get(name)
        if grad is not None and other is not None and grad.dtype != other.dtype:
            differ[name] = (grad.dtype, other.dtype)
    if differ:
        raise AssertionError(f"gradient dtypes (wrapped, shadow) differ: {differ}")


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=_LR[kind], momentum=0.9)
    return torch.optim.Adam(params, lr=_LR[kind], eps=ADAM_EPS)


def wrap_plan(impl: FSDPAdapter, model: nn.Module, example: Example) -> nn.Module:
    """Wrap each path of ``example.wrap`` (deepest first) as its own unit, then the root."""
    spec = WrapSpec(strategy=example.strategy, use_orig_params=example.use_orig_params,
                    mixed_precision=mixed_precision_spec(example.policy))
    for path in sorted(example.wrap, key=lambda p: p.count("."), reverse=True):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, name, impl.wrap(getattr(parent, name), spec))
    return impl.wrap(model, spec)


def _batch_seed(example: Example, step: int, micro: int, rank: int) -> int:
    return ((example.seed * 8 + step) * 8 + micro) * 8 + rank


@dataclass
class _Run:
    """One example's two models on this rank."""

    example: Example
    impl: FSDPAdapter
    rank: int
    device: torch.device
    model: nn.Module
    local: nn.Module
    optim: torch.optim.Optimizer
    local_optim: torch.optim.Optimizer
    low: nn.Module | None = None  # the baseline's low-precision copy under a policy
    mismatch: str | None = None

    @property
    def dtype(self) -> torch.dtype:
        return dtype_of(self.example.dtype)

    def compare(self, label: str, check: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """``check(*args, **kwargs)``; keep the first mismatch (the step goes on: see the module note)."""
        try:
            check(*args, **kwargs)
        except AssertionError as exc:
            if self.mismatch is None:
                lines = str(exc).strip().splitlines()
                self.mismatch = f"{label}: {' | '.join(lines[:6])}"

    def step(self, step: int) -> None:
        """One optimizer step: micro-batches, grads, the update, params."""
        self.forward_backward(step)
        if self.example.use_orig_params:  # the original parameters stay registered on the module
            self.compare("parameters registered after backward", _assert_same_count,
                         list(self.model.parameters()), list(self.local.parameters()))
        grads = full_grads(self.impl, self.model)  # None: not exposed for this wrap; params still compared
        if grads is not None:
            want, policy = named_grads(self.local), self.example.policy
            self.compare("grads after backward", assert_close_named, in_compute_dtype(zeros_for_none(grads, want),
                         policy), in_compute_dtype(zeros_for_none(want, grads), policy), what="grads")
        for optim in (self.optim, self.local_optim):
            optim.step()
            optim.zero_grad(set_to_none=self.example.set_to_none)
        got = self.impl.full_params(self.model)
        want_params = {name: p.detach() for name, p in self.local.named_parameters()}
        self.compare("params after step", assert_close_named, got, want_params, what="params")

    def forward_backward(self, step: int) -> None:
        """Every micro-batch: this rank's loss on the wrapped model, every rank's on the baseline."""
        ex = self.example
        for micro in range(ex.micro_batches):
            batches = [
                make_batch(ex.model, _batch_seed(ex, step, micro, r), self.dtype, self.device)
                for r in range(ex.world_size)
            ]
            output = self.model(model_input(batches[self.rank], ex.policy))
            if ex.policy is not None:
                self.compare(f"output dtype of micro-batch {micro}", assert_dtypes, output, ex.policy.param_dtype)
            loss = loss_of(output)
            loss.backward()
            want = self.local_backward(batches)[self.rank]
            self.compare(f"loss of micro-batch {micro}", torch.testing.assert_close,
                         as_compared(loss.detach(), ex.policy), as_compared(want, ex.policy))

    def local_backward(self, batches: list[torch.Tensor]) -> list[torch.Tensor]:
        """The baseline's backward of every rank's batch; each rank's loss."""
        if self.example.policy is not None:
            assert self.low is not None
            return local_backward(self.local, self.low, batches, self.example.policy)
        local_losses = [loss_of(self.local(batch)) for batch in batches]
        (sum(local_losses) / self.example.world_size).backward()  # type: ignore[union-attr]
        return [loss.detach() for loss in local_losses]


def assert_dtypes(output: torch.Tensor | tuple[torch.Tensor, ...], want: str) -> None:
    outputs = output if isinstance(output, tuple) else (output,)
    got = [str(o.dtype).removeprefix("torch.") for o in outputs]
    if any(name != want for name in got):
        raise AssertionError(f"the wrapped model's outputs are {got}, expected {want} (the policy's param_dtype)")


def _assert_same_count(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    if len(got) != len(want):
        raise AssertionError(f"the wrapped model has {len(got)} parameters, the local model {len(want)}")


def unwrapped_name(name: str) -> str:
    """``name`` without the activation-checkpoint wrapper this fuzzer may put in (the shadow has none)."""
    return ".".join(part for part in name.split(".") if part != "_checkpoint_wrapped_module")


def unwrapped_names(named: dict[str, Any]) -> dict[str, Any]:
    """``named`` with :func:`unwrapped_name` names."""
    return {unwrapped_name(name): value for name, value in named.items()}


def assert_no_grads_outside_the_loss(units: Sequence[UnitInfo], grads: dict[str, torch.Tensor | None] | None,
                                     local: nn.Module) -> None:
    """A unit none of whose parameters has a gradient in ``local`` shows the user none either.

    torch leaves ``grad`` None on a parameter that took no part in any loss since its gradient was
    last set to None (and on a frozen one); a zero gradient is not that. What the user sees is
    ``grads`` (the full gradients, by the local model's names) where the adapter exposes them, else
    the unit's own local gradients (a flat parameter's, which its optimizer steps). A flat parameter
    cannot tell None from zero for some parameters of a unit whose others are used, so only whole
    units are judged (never the root: it holds the head). Unit names are :func:`unwrapped_name`'s.
    """
    fqns = {unit.fqn: unwrapped_name(unit.fqn) for unit in units}
    named = dict(local.named_parameters())
    owner = {name: max((f for f in fqns.values() if f and name.startswith(f + ".")), key=len, default="")
             for name in named}
    for unit in units:
        owned = [name for name in named if fqns[unit.fqn] and owner[name] == fqns[unit.fqn]]
        if not owned or any(named[name].grad is not None for name in owned):
            continue
        seen = unit.local_grads if grads is None else [grads.get(name) for name in owned]
        present = [grad is not None for grad in seen]
        if any(present):
            raise AssertionError(f"unit {fqns[unit.fqn]!r} took no part in a loss (its {len(owned)} parameters have "
                                 f"no gradient locally), yet shows gradients {present}: a zero gradient is not None")


def _prefixed(prefix: str) -> Callable[[str], str]:
    return lambda message: prefix + message


def _common_dtype(got: Any, want: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Both values as CPU tensors of the dtype they promote to, so they are compared at that dtype's default
    tolerance (a float32 moment at float32's, not float64's; an int step count exactly)."""
    got_t, want_t = torch.as_tensor(got).cpu(), torch.as_tensor(want).cpu()
    dtype = torch.promote_types(got_t.dtype, want_t.dtype)
    return got_t.to(dtype), want_t.to(dtype)


def assert_optim_state(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]]) -> None:
    """Per-parameter optimizer state equal; a parameter with state on one side only must have all-zero
    tensors there (see [Note: stateful invariant] in :mod:`conformance.fuzz.stateful`), whatever its
    step count."""
    for name in sorted(set(got) | set(want)):
        if name in got and name in want:
            for key in sorted(set(got[name]) | set(want[name])):
                if key not in got[name] or key not in want[name]:
                    raise AssertionError(f"optim[{name}]: {key!r} on one side only")
                got_value, want_value = _common_dtype(got[name][key], want[name][key])
                torch.testing.assert_close(got_value, want_value, msg=_prefixed(f"optim[{name}][{key}]: "))
            continue
        one = got.get(name, want.get(name, {}))
        nonzero = [k for k, v in one.items() if k != "step" and isinstance(v, torch.Tensor) and bool(v.any())]
        if nonzero:
            side = "wrapped model" if name in got else "shadow"
            raise AssertionError(f"optim[{name}]: only the {side} has state, and its {nonzero} are not zero")


def zeros_for_none(
    grads: dict[str, torch.Tensor | None], other: dict[str, torch.Tensor | None]
) -> dict[str, torch.Tensor | None]:
    """``grads`` with a ``None`` replaced by zeros where ``other`` has a tensor (see the module note)."""
    out: dict[str, torch.Tensor | None] = {}
    for name, grad in grads.items():
        peer = other.get(name)
        out[name] = torch.zeros_like(peer) if grad is None and peer is not None else grad
    return out


def _setup(ctx: RankContext, impl: FSDPAdapter, example: Example) -> _Run:
    dtype = dtype_of(example.dtype)
    local = build_model(example.model, example.seed, dtype, ctx.device)
    model = wrap_plan(impl, build_model(example.model, example.seed, dtype, ctx.device), example)
    return _Run(
        example=example,
        impl=impl,
        rank=ctx.rank,
        device=ctx.device,
        model=model,
        local=local,
        optim=make_optimizer(example.optimizer, model.parameters()),
        local_optim=make_optimizer(example.optimizer, local.parameters()),
        low=low_precision_model(local, example.policy),
    )


def attempt(what: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """``(fn(*args), None)``, or ``(None, failure text)`` if it raised."""
    try:
        return fn(*args), None
    except Exception as exc:  # noqa: BLE001 - any exception is this rank's verdict (see the module note)
        text = str(exc).strip().splitlines()
        return None, f"{what}: {type(exc).__name__}: {' | '.join(text[:6])}"


def fail(message: str) -> None:
    """Raise ``AssertionError(message)`` (a check with its verdict already made, for ``compare``)."""
    raise AssertionError(message)


def agree(ctx: RankContext, failure: str | None) -> str | None:
    """The first rank's failure text, the same on every rank, or ``None`` if none failed."""
    failures = ctx.all_gather_object(failure)
    return next((f"rank {rank}: {text}" for rank, text in enumerate(failures) if text), None)


def check_example(ctx: RankContext, impl: FSDPAdapter, example: Example) -> str | None:
    """Train ``example`` on ``impl`` and on the baseline; the first failure (same on every rank) or ``None``."""
    if example.world_size != ctx.world_size:
        raise ValueError(f"example is for world_size {example.world_size}, running on {ctx.world_size} ranks")
    run, failure = attempt("wrap", _setup, ctx, impl, example)
    failure = agree(ctx, failure)
    if failure is not None:
        return failure
    for step in range(example.steps):
        raised = attempt("raised", run.step, step)[1]
        failure = agree(ctx, raised or run.mismatch)
        if failure is not None:
            return f"step {step}, {failure}"
    return None


def run_example(ctx: RankContext, impl: FSDPAdapter, example: Example) -> None:
    """A reproducer's body: fail with the first mismatch of ``example`` on every rank."""
    failure = check_example(ctx, impl, example)
    if failure is not None:
        raise AssertionError(f"{impl.name} differs from the local baseline: {failure}")
