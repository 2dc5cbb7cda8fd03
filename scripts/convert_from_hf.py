"""Import a Hugging Face ``LlamaForCausalLM`` or ``Qwen3MoeForCausalLM`` folder as a model-only meshtrain checkpoint.

Usage: ``python scripts/convert_from_hf.py HF_DIR CHECKPOINT_DIR``

HF_DIR holds ``config.json`` and safetensors weights (one file or shards with an index).
CHECKPOINT_DIR, new or empty, receives a ``torch.distributed.checkpoint`` folder holding only
``{"model": ...}`` plus ``model_args.json`` derived from ``config.json``, checksummed as the
trainer's own checkpoints and moved into place only once whole; the trainer loads it on any mesh. Weights are stored in float32, the dtype of the trainer's parameters (casting from
bfloat16 or float16 is exact). A tied ``lm_head`` (Llama 3.2) becomes a separate output matrix
that starts as a copy of the embedding. Tensors are read and cast one at a time, so memory
peaks at the float32 model the checkpoint is written from, with no second copy in the folder's dtype.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from anywhere

from trainer.checkpoint.hf_folders import HFFolder  # noqa: E402
from trainer.checkpoint.model_entry import write_dcp_model  # noqa: E402
from trainer.model.hf_architectures import adapter_for_config  # noqa: E402
from trainer.runtime.errors import UserError, report  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", type=Path, help="Hugging Face model folder (config.json + safetensors)")
    parser.add_argument("checkpoint_dir", type=Path, help="new or empty folder for the training checkpoint")
    opts = parser.parse_args(argv)
    try:
        folder = HFFolder(opts.hf_dir)
        adapter = adapter_for_config(folder.config)
        args = adapter.model_args_from_hf_config(folder.config)
        tied = bool(folder.config.get("tie_word_embeddings"))
        adapter.check_hf_shapes(folder.shapes, args, tie_word_embeddings=tied)
        ours = {
            name: adapter.read_box(
                name, args, tuple(slice(0, n) for n in shape), folder.read, tie_word_embeddings=tied
            ).float()
            for name, (_, shape) in adapter.hf_layout(args).items()
        }
        write_dcp_model(opts.checkpoint_dir, ours, args)
    except UserError as err:
        sys.exit(report(err, program="convert_from_hf"))
    n_params = sum(t.numel() for t in ours.values())
    print(f"wrote {opts.checkpoint_dir}: {n_params:,} parameters, {args}")


if __name__ == "__main__":
    main()
