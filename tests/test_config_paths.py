"""Path keys take file-system paths: a URL is refused naming the key, never made a local folder;
only the checkpoint keys take one (``tests/test_checkpoint_object_store.py``)."""

from __future__ import annotations

import re

import pytest

from trainer.config import load_config
from trainer.runtime.errors import ConfigError


def test_a_url_in_any_path_key_is_refused_naming_it_not_written_to_a_local_folder():
    """``s3://bucket/ckpt`` as a path would be a local folder ``s3:/bucket/ckpt``, lost with the node."""
    from trainer.config.schema import FIELDS
    from trainer.config.validate import URL_KEYS

    keys = [key for key in FIELDS if key.split(".")[1].endswith(("_path", "folder"))]
    assert {"checkpoint.folder", "checkpoint.initial_load_path", "job.dump_folder", "training.dataset_path"} <= set(
        keys
    )
    for key in keys:
        for url in ("s3://bucket/run", "gs://bucket/run", "file:///tmp/run"):
            if key in URL_KEYS:
                config = load_config([f"--{key}", url, "--checkpoint.enable"])
                assert getattr(config.checkpoint, key.split(".")[1]) == url
                continue
            with pytest.raises(ConfigError, match=rf"`{re.escape(key)}` = '{re.escape(url)}' is a URL") as refused:
                load_config([f"--{key}", url])
            assert "\n" not in str(refused.value) and "mount the bucket" in str(refused.value)
