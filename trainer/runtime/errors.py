"""Failures a user can act on, as opposed to bugs.

Every entry point catches :class:`UserError` alone and prints it as one line with its exit code:
the message already says what happened, what was kept, and what to do. Anything else is a bug
(in meshtrain, torch or a library) and keeps its traceback, so it is never mistaken for a
mistake in the config.

The subclasses that describe bad *input* also derive from ``ValueError``, the exception Python
code conventionally raises for a bad argument, so library callers that catch ``ValueError`` keep
working; the entry points never catch ``ValueError`` itself.
"""

from __future__ import annotations

import sys


class UserError(Exception):
    """Something the user can fix; the message names the key, file or rank and the fix."""

    exit_code = 2
    label = "error"


class ConfigError(UserError, ValueError):
    """A mistake in the configuration, the mesh or the environment, found before any process
    group exists."""

    label = "config error"


class DataError(UserError, ValueError):
    """A dataset, tokenizer or prepared folder that cannot be trained on as given."""

    label = "data error"


class BusyFolderError(UserError):
    """The dump folder is held by a running job."""

    label = "busy dump folder"


class JobError(UserError, RuntimeError):
    """The job cannot go on once running (divergence, a stalled rank, a full disk, a checkpoint
    that does not fit): exit 1, after the message says what is kept."""

    exit_code = 1


class CheckpointError(JobError):
    """A checkpoint that cannot be loaded into this run: missing, damaged, of another model or
    trained on other data; or a Hugging Face folder that cannot be converted."""


def report(error: UserError, program: str = "meshtrain") -> int:
    """Print ``error`` as one line on stderr; return its exit code."""
    print(f"{program}: {error.label}: {error}", file=sys.stderr, flush=True)
    return error.exit_code
