"""Export a meshtrain training checkpoint as a Hugging Face ``LlamaForCausalLM`` folder.

Usage: ``python scripts/convert_to_hf.py CHECKPOINT_DIR OUTPUT_DIR [--dtype bfloat16|float32|float16]``

CHECKPOINT_DIR is a ``{dump_folder}/checkpoint/step-N`` folder (DCP files and
``model_args.json``). OUTPUT_DIR receives ``config.json`` and safetensors weights, loadable with
``LlamaForCausalLM.from_pretrained(OUTPUT_DIR)``. Runs in one process without a GPU or a process
group, whatever mesh saved the checkpoint; it holds the full model in memory. The tokenizer is
not exported: Hugging Face tokenizers are a separate format.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from anywhere

from trainer.checkpoint.folders import read_dcp_model, read_model_args  # noqa: E402
from trainer.checkpoint.hf_folders import save_hf_folder  # noqa: E402
from trainer.model.hf_llama3 import HF_DTYPES  # noqa: E402
from trainer.runtime.errors import UserError, report  # noqa: E402

DTYPES = {name: dtype for dtype, name in HF_DTYPES.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint_dir", type=Path, help="training checkpoint folder (.../checkpoint/step-N)")
    parser.add_argument("output_dir", type=Path, help="new or empty folder for the Hugging Face model")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bfloat16",
        help="dtype of the exported weights (default: bfloat16, as published Llama 3 weights)",
    )
    opts = parser.parse_args(argv)
    try:
        args = read_model_args(opts.checkpoint_dir)
        state_dict = read_dcp_model(opts.checkpoint_dir)
        save_hf_folder(opts.output_dir, state_dict, args, DTYPES[opts.dtype])
    except UserError as err:
        sys.exit(report(err, program="convert_to_hf"))
    n_params = sum(t.numel() for t in state_dict.values())
    print(f"wrote {opts.output_dir}: {n_params:,} parameters in {opts.dtype}")


if __name__ == "__main__":
    main()
