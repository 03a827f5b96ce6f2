"""A per-rank communication worker: a CPU stand-in for a CUDA communication stream.

[Note: communication worker]
On a GPU, FSDP overlaps communication with compute because collectives run on
a separate stream. On CPU there is no such stream: gloo runs a collective on
the calling thread. :func:`comm_worker` intercepts the collectives of one rank
(through :func:`harness.collectives.recorder.patch_collectives`, which sees them as
dispatcher ops: [Note: observing collectives]) and runs them, in issue order,
on one worker thread per rank, each first sleeping ``comm_ms`` (the stand-in
for transfer time; ``time.sleep`` releases the GIL). The caller gets control
back at once and waits only where the collective's own API waits:

- a ``c10d::`` op (what every ``torch.distributed`` function reaches) returns a
  ``Work`` made from a future the worker completes
  (``_create_work_from_future``, boxed for the dispatcher); the
  ``torch.distributed`` function returns it for ``async_op=True`` and waits on
  it otherwise, exactly as the real call would;
- a functional collective (DTensor's) returns at once an output the worker
  fills in (an empty tensor shaped by the op's meta kernel, or the tensor an
  in-place / ``out=`` variant writes); its ``wait_tensor`` blocks until the
  worker finished it.

So an implementation that issues collectives early and waits late overlaps
them with compute, and one that waits at once does not. Every collective's
issue, start and end times are kept for evidence (:attr:`CommWorker.timeline`).

Process ranks only: under thread ranks the threaded group resolves the
calling thread's world, which a worker thread does not have, and its
``torch.distributed`` calls never become dispatcher ops.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from harness.collectives.observe import C10D, bind, op_info, tensors_in
from harness.collectives.recorder import patch_collectives

__all__ = ["CommWorker", "Event", "comm_worker"]


@dataclass
class Event:
    """One collective on the worker, times in ms since the worker started."""

    op: str
    issued_ms: float
    started_ms: float = -1.0
    ended_ms: float = -1.0


class _Done:
    """Set when the worker finished one collective; ``wait`` re-raises the worker's error.

    ``future`` (a ``c10d::`` op's): completed alongside, with ``outputs`` or the error.
    """

    def __init__(self, future: torch.futures.Future[Any] | None = None, outputs: Any = None) -> None:
        self._event = threading.Event()
        self.error: BaseException | None = None
        self.future, self.outputs = future, outputs

    def finish(self, error: BaseException | None) -> None:
        self.error = error
        self._event.set()
        if self.future is not None:
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(self.outputs)

    def wait(self) -> None:
        self._event.wait()
        if self.error is not None:
            raise self.error


@dataclass
class CommWorker:
    """One rank's communication thread (see [Note: communication worker])."""

    comm_ms: float
    ops: frozenset[str]
    timeline: list[Event] = field(default_factory=list)
    _queue: queue.Queue[Any] = field(default_factory=queue.Queue)
    _origin: float = field(default_factory=time.perf_counter)
    _thread: threading.Thread | None = None
    #: Storage address of a functional collective's output -> its collective, until waited for.
    _pending: dict[int, _Done] = field(default_factory=dict)
    #: Inside :meth:`undelayed`: collectives run on the caller's thread, neither delayed nor recorded.
    _passthrough: bool = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="comm-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=60)
            if self._thread.is_alive():
                raise RuntimeError("communication worker did not stop within 60 s (a collective is stuck)")

    def drain(self) -> None:
        """Block until every collective issued so far has finished."""
        done = threading.Event()
        self._queue.put(done)
        done.wait()

    @contextmanager
    def undelayed(self) -> Iterator[None]:
        """Inside the block this rank's collectives run at once on the calling thread, as without the
        worker: not delayed, not in :attr:`timeline` (for work that is not timed). Drains first."""
        self.drain()
        self._passthrough = True
        try:
            yield
        finally:
            self._passthrough = False

    def _now(self) -> float:
        return (time.perf_counter() - self._origin) * 1e3

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):  # drain marker: everything before it is done
                item.set()
                continue
            event, run, done = item
            event.started_ms = self._now()
            try:
                time.sleep(self.comm_ms / 1e3)
                with torch.no_grad():  # the caller's autograd already wrapped the output
                    run()
                done.finish(None)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                done.finish(exc)
            event.ended_ms = self._now()

    def _submit(self, op: str, run: Callable[[], None], done: _Done | None = None) -> _Done:
        event = Event(op, issued_ms=self._now())
        self.timeline.append(event)
        done = done or _Done()
        self._queue.put((event, run, done))
        return done

    def __call__(self, op: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if op not in self.ops or self._passthrough:
            return fn(*args, **kwargs)
        info = op_info(fn)
        if info is None:
            raise TypeError(f"{op}: {getattr(fn, '__name__', fn)} on a Python process group never reaches the "
                            "dispatcher; the communication worker runs dispatcher collectives only (process ranks)")
        if info.layer == C10D:
            return self._c10d(op, fn, args, kwargs)
        return self._functional(op, fn, args, kwargs)

    def _c10d(self, op: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Issue a ``c10d::`` op on the worker; the caller gets a Work it may wait on when it likes."""
        future: torch.futures.Future[Any] = torch.futures.Future()
        outputs = bind(fn, args, kwargs)[fn._schema.arguments[0].name]

        def run() -> None:
            result = fn(*args, **kwargs)
            work = result[-1] if isinstance(result, tuple) else result
            dist.distributed_c10d.Work.unbox(work).wait()

        self._submit(op, run, _Done(future, tensors_in(outputs)))
        work = torch._C._distributed_c10d._create_work_from_future(future).boxed()  # type: ignore[attr-defined]
        return (outputs, work) if len(fn._schema.returns) == 2 else work

    def _functional(self, op: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Issue a functional collective on the worker; its output is returned now and filled in later."""
        bound = bind(fn, args, kwargs)
        written = [bound[a.name] for a in fn._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        outputs = written[0] if written else _empty_outputs(fn, args, kwargs)

        def run() -> None:
            result = fn(*args, **kwargs)
            for out, got in zip(tensors_in(outputs), tensors_in(result), strict=True):
                got = torch.ops._c10d_functional.wait_tensor(got)
                if out.data_ptr() != got.data_ptr():
                    out.copy_(got)

        done = self._submit(op, run)
        for tensor in tensors_in(outputs):
            self._pending[tensor.untyped_storage().data_ptr()] = done
        return outputs

    def wait_for(self, tensor: torch.Tensor) -> None:
        """Before ``wait_tensor(tensor)``: block until the worker wrote ``tensor`` (if it is one of its outputs)."""
        done = self._pending.pop(tensor.untyped_storage().data_ptr(), None)
        if done is not None:
            done.wait()

    def render(self) -> str:
        """The timeline as text: op, issued, started, ended (ms)."""
        return "\n".join(f"{e.op:24s} issued {e.issued_ms:8.1f}  start {e.started_ms:8.1f}  end {e.ended_ms:8.1f}"
                         for e in self.timeline)


def _empty_outputs(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Uninitialised tensors shaped as ``fn``'s outputs, from its meta kernel, on the input's device."""
    device = tensors_in(list(args))[0].device

    def meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.empty_like(value, device="meta")
        if isinstance(value, (list, tuple)):
            return type(value)(meta(item) for item in value)
        return value

    shaped = fn(*meta(list(args)), **{k: meta(v) for k, v in kwargs.items()})
    if isinstance(shaped, torch.Tensor):
        return torch.empty_like(shaped, device=device)
    return [torch.empty_like(t, device=device) for t in shaped]


DEFAULT_OPS = frozenset({"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather",
                         "reduce_scatter", "broadcast"})


@contextmanager
def comm_worker(comm_ms: float, ops: frozenset[str] = DEFAULT_OPS) -> Iterator[CommWorker]:
    """Run this rank's collectives on a worker thread, each delayed by ``comm_ms``.

    Collective: every rank enters and leaves together. Collectives not routed
    through the worker (e.g. ``barrier``) must not be issued inside the block
    while routed ones are pending.
    """
    worker = CommWorker(comm_ms=comm_ms, ops=ops)
    worker.start()
    try:
        with patch_collectives(worker, on_wait=worker.wait_for):
            try:
                yield worker
            finally:
                worker.drain()  # nothing in flight when the unpatching barrier runs
    finally:
        worker.stop()
