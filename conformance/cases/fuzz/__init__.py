"""The parity fuzzer: random small models, wrap plans and training loops, against a local baseline.

- :mod:`conformance.cases.fuzz.example`: an example as plain data and the hypothesis strategy drawing it;
- :mod:`conformance.cases.fuzz.model`: the module and inputs an example describes;
- :mod:`conformance.cases.fuzz.precision`: a drawn mixed-precision policy, its local baseline and tolerances;
- :mod:`conformance.cases.fuzz.runner`: one example on the ranks, compared step by step with the baseline;
- :mod:`conformance.cases.fuzz.driver`: the hypothesis loop across ranks, budgets, reproducers.

The stateful fuzzer: random sequences of a user's operations, checked after each against a shadow model.

- :mod:`conformance.cases.fuzz.ops`: a program (configuration and operations) as plain data, and its strategy;
- :mod:`conformance.cases.fuzz.shadow`: the local shadow model, the oracle;
- :mod:`conformance.cases.fuzz.controls`: a program on a ``fully_shard``-ed model and its FSDP2 controls;
- :mod:`conformance.cases.fuzz.stateful`: one program on the ranks, the invariant, budgets, reproducers.

The matrix rows are ``fuzz/parity_ws{1,2,4}`` in ``conformance/cases/test_fuzz.py`` and
``fuzz/stateful_ws{1,2,4}`` in ``conformance/cases/test_fuzz.py``.
"""
