"""Export a meshtrain training checkpoint as a Hugging Face ``LlamaForCausalLM`` folder, or
``Qwen3MoeForCausalLM`` for an MoE checkpoint of Qwen3-MoE's options.

Usage: ``python scripts/convert_to_hf.py CHECKPOINT_DIR OUTPUT_DIR [--dtype bfloat16|float32|float16]``

CHECKPOINT_DIR is a ``{dump_folder}/checkpoint/step-N`` folder (DCP files and
``model_args.json``). OUTPUT_DIR receives ``config.json``, ``generation_config.json`` and safetensors weights
(``model-0000k-of-0000n.safetensors`` shards with an index past ``--max-shard-bytes``), loadable
with ``AutoModelForCausalLM.from_pretrained(OUTPUT_DIR)``; with ``--tokenizer`` (the run's
``model.tokenizer_path``) also the tokenizer files. Runs in one process without a GPU or a process
group, whatever mesh saved the checkpoint, and streams: one tensor is read from the checkpoint,
converted and written before the next, so memory stays at about the largest tensor, not the model.
The checkpoint's files are verified against its ``checksums.json`` first, as a resume verifies
them, and OUTPUT_DIR gains its files only once all are written (a full disk leaves it as it was).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from anywhere

from trainer.checkpoint.folders import MODEL_ARGS_FILE, read_model_args  # noqa: E402
from trainer.checkpoint.hf_folders import DEFAULT_MAX_SHARD_BYTES, export_hf_folder  # noqa: E402
from trainer.checkpoint.location import display, location  # noqa: E402
from trainer.checkpoint.model_entry import check_model_entries, dcp_model_reader  # noqa: E402
from trainer.model.hf_architectures import adapter_for_args  # noqa: E402
from trainer.model.hf_llama3 import HF_DTYPES, InteropError  # noqa: E402
from trainer.model.llama3 import ModelArgs  # noqa: E402
from trainer.model.moe import MoEArgs  # noqa: E402
from trainer.runtime.errors import UserError, report  # noqa: E402

DTYPES = {name: dtype for dtype, name in HF_DTYPES.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "checkpoint_dir", help="training checkpoint folder (.../checkpoint/step-N), or its URL (s3://.../step-N)"
    )
    parser.add_argument("output_dir", type=Path, help="new or empty folder for the Hugging Face model")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="dtype of the exported weights (default: bfloat16, as published Llama 3 weights)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="the run's tokenizer (`model.tokenizer_path`: a tokenizer.json or a SentencePiece .model), copied along",
    )
    parser.add_argument(
        "--max-shard-bytes",
        type=int,
        default=DEFAULT_MAX_SHARD_BYTES,
        help="largest safetensors file before the weights are split into shards (default: 5 GB, as Hugging Face)",
    )
    opts = parser.parse_args(argv)
    try:
        checkpoint = location(opts.checkpoint_dir)
        args = read_model_args(checkpoint)
        try:
            adapter_for_args(args).hf_config(args, DTYPES[opts.dtype])  # a model the format cannot hold
        except InteropError as err:
            raise InteropError(f"{display(checkpoint / MODEL_ARGS_FILE)}: {err}") from None
        check_model_entries(checkpoint, args)
        read = dcp_model_reader(checkpoint)
        export_hf_folder(
            opts.output_dir,
            read,
            args,
            DTYPES[opts.dtype],
            max_shard_bytes=opts.max_shard_bytes,
            tokenizer=opts.tokenizer,
        )
    except UserError as err:
        sys.exit(report(err, program="convert_to_hf"))
    print(f"wrote {opts.output_dir}: {args.n_layers}-layer {type(args).__name__} model in {opts.dtype}")
    if routing_bias_dropped(read, args):
        print(
            f"warning: {display(opts.checkpoint_dir)} routes with a learned expert bias (`moe.bias_update_rate`), which a "
            "Qwen3MoeForCausalLM has no place for: the exported model chooses its experts without it.",
            file=sys.stderr,
        )


def routing_bias_dropped(read: Callable[[str], torch.Tensor], args: ModelArgs) -> bool:
    """Whether the checkpoint's MoE layers have a nonzero aux-loss-free routing bias, which only
    moves the top-k choice and so changes which experts a token reaches."""
    if not isinstance(args, MoEArgs) or any(
        name.endswith("expert_bias") for name in adapter_for_args(args).hf_layout(args)
    ):
        return False  # no routing, or the format holds the bias
    try:
        return any(
            bool(read(f"layers.{layer}.feed_forward.expert_bias").any())
            for layer in range(args.n_dense_layers, args.n_layers)
        )
    except KeyError:
        return False


if __name__ == "__main__":
    main()
