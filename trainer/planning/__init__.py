"""Planning a job before any process exists: the per-rank memory estimate (``memory_plan``) and
the memory a rank may use (``memory_limits``)."""
