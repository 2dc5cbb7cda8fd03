"""The converters given what a user gives them by mistake, or a disk that refuses: one line that
names the file or folder and the fix, the exit code, and nothing written that blocks the rerun.

Through each script's ``main(argv)``, and on a real full or read-only tmpfs (the approach of
``test_dump_folder_mid_run.py``) through the script itself, the same command then rerun on a
disk with room. (Bit-exact conversions and the happy paths are in ``test_hf_interop.py``.)
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from harness import ROOT, needs_tmpfs

from trainer.checkpoint.hf_folders import save_hf_folder
from trainer.checkpoint.model_entry import read_dcp_model, write_dcp_model
from trainer.model.llama3 import ModelArgs, Transformer

sys.path.insert(0, str(ROOT / "scripts"))
import convert_from_hf
import convert_to_hf

ARGS = replace(ModelArgs(), dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=256, multiple_of=64)
TOKENIZER = ROOT / "assets" / "tokenizer" / "shakespeare.model"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A training checkpoint and a Hugging Face folder of the same small model (about 400 kB)."""
    root = tmp_path_factory.mktemp("converters")
    model = Transformer(ARGS)
    model.init_weights(3)
    write_dcp_model(root / "checkpoint" / "step-4", model.state_dict(), ARGS)
    save_hf_folder(root / "hf", model.state_dict(), ARGS, torch.float32)
    return {"root": root, "checkpoint": root / "checkpoint" / "step-4", "hf": root / "hf"}


def refused(main: Callable[[list[str]], None], argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The exit code and the one line a script's ``main`` printed."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return int(exited.value.code or 0), err


def test_a_checkpoint_that_no_longer_matches_its_checksums_is_not_exported(folders, tmp_path, capsys):
    damaged = tmp_path / "step-4"
    shutil.copytree(folders["checkpoint"], damaged)
    data = next(damaged.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 4] = b"\xff\xff\x7f\x7f"  # 3.4e38 in a float32
    data.write_bytes(bytes(raw))
    code, err = refused(convert_to_hf.main, [str(damaged), str(tmp_path / "hf")], capsys)
    assert code == 2 and f"{data.name} does not match its checksum" in err and "older `step-N`" in err
    assert not (tmp_path / "hf").exists()
    with pytest.raises(Exception, match="does not match its checksum"):
        read_dcp_model(damaged)


def test_what_is_not_a_training_checkpoint_is_named_with_the_right_command(folders, tmp_path, capsys):
    hf, checkpoint = folders["hf"], folders["checkpoint"]
    cases: list[tuple[Callable[[list[str]], None], Path, str]] = [
        (convert_to_hf.main, hf, f"{hf} is already a Hugging Face model folder (it has config.json); to make a "),
        (convert_to_hf.main, tmp_path / "absent", f"{tmp_path / 'absent'} does not exist; pass a `{{dump_folder}}"),
        (convert_to_hf.main, folders["root"], "It holds [checkpoint/step-4]: pass one of those folders."),
        (convert_from_hf.main, checkpoint, f"{checkpoint} is a training checkpoint, not a Hugging Face model folder"),
        (convert_from_hf.main, tmp_path / "absent", f"{tmp_path / 'absent'} does not exist; pass a Hugging Face"),
    ]
    for main, given, message in cases:
        code, err = refused(main, [str(given), str(tmp_path / "out")], capsys)
        assert code == 2 and message in err, err
        assert not (tmp_path / "out").exists()
    assert "convert_from_hf.py" in refused(convert_to_hf.main, [str(hf), str(tmp_path / "out")], capsys)[1]


def test_a_missing_tokenizer_and_a_shard_size_below_one_byte_are_refused_before_any_weight(folders, tmp_path, capsys):
    out, given = tmp_path / "hf", [str(folders["checkpoint"]), str(tmp_path / "hf")]
    code, err = refused(convert_to_hf.main, [*given, "--tokenizer", str(tmp_path / "tokenizer.json")], capsys)
    assert code == 2 and "tokenizer.json does not exist; pass the run's `model.tokenizer_path`" in err
    for size in ("0", "-1"):
        code, err = refused(convert_to_hf.main, [*given, "--max-shard-bytes", size], capsys)
        assert code == 2 and f"(`--max-shard-bytes`) must be a positive number of bytes, got {size}" in err
    assert not out.exists()
    convert_to_hf.main([*given, "--tokenizer", str(TOKENIZER)])
    assert {"model.safetensors", "tokenizer.model", "generation_config.json"} <= {p.name for p in out.iterdir()}


def test_the_files_of_an_output_folder_are_never_replaced(folders, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer.model").write_text("the user's own")
    given = [str(folders["checkpoint"]), str(out), "--tokenizer", str(TOKENIZER)]
    code, err = refused(convert_to_hf.main, given, capsys)
    assert code == 2 and f"{out} already holds ['tokenizer.model']; export into a new or empty folder" in err
    assert [p.name for p in out.iterdir()] == ["tokenizer.model"]
    assert (out / "tokenizer.model").read_text() == "the user's own"


# Inside ``unshare -rm``: a tmpfs too small (or read-only), the converter, what it left, then the
# same command again on a disk with room, which must not be blocked by the first attempt.
SCRIPT = """
mount -t tmpfs -o {options} tmpfs {mount} || exit 90
{command} 2> {err}
echo $? > {code}
ls -A {mount} > {left}
mount -o remount,rw,size=50m {mount} || exit 91
exec {command}
"""


@needs_tmpfs
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["full", "read-only"])
@pytest.mark.parametrize("script", ["convert_to_hf.py", "convert_from_hf.py"])
def test_a_full_or_read_only_disk_is_one_line_and_the_rerun_is_not_blocked(folders, tmp_path, script, fault):
    mount = tmp_path / "disk"
    mount.mkdir()
    source = folders["checkpoint" if script == "convert_to_hf.py" else "hf"]
    out = mount / "out"
    command = shlex.join([sys.executable, str(ROOT / "scripts" / script), str(source), str(out)])
    files = {name: tmp_path / name for name in ("err", "code", "left")}
    options = "size=100k" if fault == "full" else "ro,size=1m"
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", SCRIPT.format(options=options, mount=mount, command=command, **files)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = files["err"].read_text().strip()
    assert files["code"].read_text().strip() == "1", err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    reason = "no space left on its device" if fault == "full" else f"{mount} is read-only or not writable"
    assert f"cannot {'export' if script == 'convert_to_hf.py' else 'write the checkpoint'} into {out}: {reason}" in err
    assert files["left"].read_text().split() == [], files["left"].read_text()
    assert done.returncode == 0, done.stderr[-3000:]
