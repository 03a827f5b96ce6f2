"""The fuzz engine: two fuzzers, run by the case module ``conformance/cases/test_fuzz.py``.

The parity fuzzer: random small models, wrap plans and training loops, against a local baseline.

- :mod:`conformance.fuzz.example`: an example as plain data and the hypothesis strategy drawing it;
- :mod:`conformance.fuzz.model`: the module and inputs an example describes;
- :mod:`conformance.fuzz.drawn_precision`: a drawn mixed-precision policy, its local baseline and tolerances;
- :mod:`conformance.fuzz.parity_run`: one example on the ranks, compared step by step with the baseline;
- :mod:`conformance.fuzz.driver`: the hypothesis loop across ranks, budgets, reproducers.

The stateful fuzzer: random sequences of a user's operations, checked after each against a shadow model.

- :mod:`conformance.fuzz.ops`: a program (configuration and operations) as plain data;
- :mod:`conformance.fuzz.drawing`: the hypothesis strategies drawing programs;
- :mod:`conformance.fuzz.shadow`: the local shadow model, the oracle;
- :mod:`conformance.fuzz.wrapping`: a program's wrapped model, what an adapter can run, its reproducer;
- :mod:`conformance.fuzz.controls`: a program on a ``fully_shard``-ed model and its FSDP2 controls;
- :mod:`conformance.fuzz.held`: the memory a rank may hold between operations, and a dropped model freed;
- :mod:`conformance.fuzz.gathers`: the all-gathers a backward issues, against the resharding promised;
- :mod:`conformance.fuzz.prefetching`: ``fully_shard``'s explicit prefetch lists, followed in order;
- :mod:`conformance.fuzz.neighbours`: a configuration's neighbours, misuses refused and options honoured;
- :mod:`conformance.fuzz.option_neighbours`: the neighbours that set a construction option the program has not;
- :mod:`conformance.fuzz.unsynced`: the neighbour showing where gradients kept without sync add up;
- :mod:`conformance.fuzz.machine`: a program's wrapped model, optimizer and shadow, each operation applied to both;
- :mod:`conformance.fuzz.stateful`: one program on the ranks, the invariant, checked after every operation;
- :mod:`conformance.fuzz.searching`: programs drawn per world size, run and shrunk, with their budget.

Shared by both:

- :mod:`conformance.fuzz.agreement`: a failure kept, then the same verdict on every rank;
- :mod:`conformance.fuzz.twin_checks`: the checks of the wrapped model against its local twin;
- :mod:`conformance.fuzz.drawn_optimizers`: the optimizers both train with.

The engine imports the contract, :mod:`fixtures` and :mod:`harness`, never the case modules. The
matrix rows are ``fuzz/parity_ws{1,2,4}`` and ``fuzz/stateful_ws{1,2,4}`` in
``conformance/cases/test_fuzz.py``.
"""
