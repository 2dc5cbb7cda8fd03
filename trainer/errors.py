"""Failures a user can act on, as opposed to bugs.

A :class:`JobError` ends the job with its message and a non-zero exit, without a traceback:
the message already says what happened, what was kept, and what to do. Configuration mistakes
are :class:`~trainer.config.ConfigError` (exit 2, before any process group exists); a
``JobError`` is what goes wrong while the job runs (exit 1).
"""


class JobError(RuntimeError):
    """The job cannot go on; the message names the cause, what is kept, and the fix."""
