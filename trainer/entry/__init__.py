"""The roof: the ways into a job.

The launcher behind ``./run_train.sh`` (``launch``), the preparation every entry point shares
(``job``: config, plan, memory check, data), each training process's ``main`` (``worker``) and
``--simulate`` (``simulate``). They may import anything below them; nothing in ``trainer`` or
``parallelisms`` imports them, only ``scripts/``, ``benchmarks/`` and the tests.
"""
