"""Tokenize a corpus once into a prepared folder that training memory-maps.

    python scripts/prepare_data.py --tokenizer assets/tokenizer/shakespeare.model --out data/web \\
        --workers 8 corpus/*.jsonl.gz
    ./run_train.sh --training.dataset_path data/web

Inputs are .txt files (one document each), .jsonl and .jsonl.gz files (one document per line's
"text"), .parquet files (one per row's "text" column; pip install -e ".[parquet]"), or folders of
them (searched recursively). Rerunning after an interruption keeps the
finished shards (verified by hash). Preparing into a folder prepared before keeps its old
contents whole until the new ones are complete; one run at a time may write a folder.
``--verify FOLDER`` re-hashes every shard of a prepared folder.
See trainer/data/shards.py for the folder's format.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.data.prepare import UNIT_BYTES, prepare
from trainer.data.shards import verify
from trainer.runtime.errors import UserError, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*", help=".txt / .jsonl / .jsonl.gz / .parquet files or folders of them")
    parser.add_argument(
        "--tokenizer", help="SentencePiece .model or Hugging Face tokenizer.json (model.tokenizer_path)"
    )
    parser.add_argument("--out", help="the prepared folder to write (new, empty, or prepared before)")
    parser.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: all cores)"
    )
    parser.add_argument(
        "--unit-mb",
        type=int,
        default=UNIT_BYTES >> 20,
        help="big .jsonl files (and Parquet files, by decoded size) are cut into units of this size",
    )
    parser.add_argument(
        "--verify", metavar="FOLDER", help="check every shard of a prepared folder against its manifest"
    )
    args = parser.parse_args(argv)
    try:
        if args.verify:
            problems = verify(args.verify)
            for problem in problems:
                print(f"prepare_data: {problem}", file=sys.stderr)
            print(f"prepare_data: {args.verify}: {'sound' if not problems else f'{len(problems)} problem(s)'}")
            return 1 if problems else 0
        if not args.tokenizer or not args.out:
            parser.error("--tokenizer and --out are required (or --verify FOLDER)")
        manifest = prepare(args.inputs, args.tokenizer, args.out, args.workers, args.unit_mb << 20)
    except UserError as exc:
        return report(exc, program="prepare_data")
    except KeyboardInterrupt:
        print(
            "\nprepare_data: interrupted; what --out held before is intact: rerun the same command to continue "
            "(finished shards are kept)",
            file=sys.stderr,
        )
        return 130
    print(
        f"prepare_data: {args.out}: {manifest['total_documents']:,} documents, {manifest['total_tokens']:,} tokens "
        f"({manifest['dtype']}) in {len(manifest['shards'])} shard(s), {manifest['reused_units']} reused from a previous run"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
