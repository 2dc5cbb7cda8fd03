"""Planning a job before any process exists: what the config resolves to on a world size
(``job_plan``), the per-rank memory estimate (``memory_plan``) and the memory a rank may use
(``memory_limits``). Planning reads files (the config's tokenizer) but writes none."""
