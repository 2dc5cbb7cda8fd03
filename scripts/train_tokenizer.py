"""Train the bundled demo tokenizer, assets/tokenizer/shakespeare.model.

Usage: ``python scripts/train_tokenizer.py [--output PATH]``

A Llama-style SentencePiece BPE model (byte fallback, so any text encodes without <unk>) sized
for the debug model: 2048 pieces keep the embedding small. It is trained on exactly the cleaned
documents the ``shakespeare`` dataset tokenizes, so the pieces fit the training text.

Settings that differ from SentencePiece's defaults, and why:

* ``normalization_rule_name="identity"``, ``remove_extra_whitespaces=False``: decode(encode(x))
  returns x unchanged (NFKC and whitespace folding would not), and the model file carries no
  ~240 KB normalization table.
* ``add_dummy_prefix=False``: SentencePiece trains on single lines, while the datasets encode
  whole documents where most lines follow a newline, not a space. Without the dummy prefix a
  line-initial word gets the same pieces in both, and prompt and response encoded separately
  match the document encoding too.
* one thread, no sentence sampling, fixed seed: re-running gives a byte-identical model.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
from pathlib import Path

import sentencepiece as spm

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from anywhere

from trainer.data.sources import read_shakespeare_plays  # noqa: E402
from trainer.runtime.errors import UserError, report  # noqa: E402

DEFAULT_OUTPUT = REPO_ROOT / "assets" / "tokenizer" / "shakespeare.model"
VOCAB_SIZE = 2048


def train(output: Path) -> None:
    # SentencePiece trains on sentences, one per line; the newlines of the documents become
    # byte-fallback tokens (<0x0A>) when the datasets encode them, as in Llama 2.
    lines = [line for play in read_shakespeare_plays() for line in play.text.split("\n") if line.strip()]
    spm.set_random_generator_seed(0)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        num_threads=1,
        minloglevel=2,
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(model.getvalue())
        os.replace(tmp, output)
    finally:
        Path(tmp).unlink(missing_ok=True)
    print(f"wrote {output} ({output.stat().st_size} bytes, {VOCAB_SIZE} pieces, {len(lines)} training lines)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write the .model file")
    try:
        train(parser.parse_args(argv).output)
    except UserError as exc:
        return report(exc, program="train_tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
