"""Print the samples of one training step, decoded, with the tokens the model does not learn marked.

    python scripts/show_batch.py --step 3 [training's own flags: --config, --training.*, ...]

The global batch of a step depends only on the data, the global batch size and the seed (never on
the mesh), so this shows exactly what ``./run_train.sh`` with the same flags trains on at that
step, without starting it. Text that is a label (learned) is printed plainly; text that is only
context (a prompt, a chat header, another role's turn) is wrapped in ``⟦…⟧`` (dimmed on a
terminal); padding is summarised as ``⟨pad × n⟩``. A mixture names each sample's dataset.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.config import ConfigError, JobConfig, load_config
from trainer.data.datasets import describe_data
from trainer.data.loader import global_order
from trainer.data.tokenizer import Tokenizer
from trainer.entry.job import prepare
from trainer.loss import IGNORE_INDEX
from trainer.runtime.errors import UserError, report

DIM, RESET = "\033[2m", "\033[0m"


def decode_visibly(tokenizer: Tokenizer, tokens: list[int]) -> str:
    """Like ``decode``, but BOS and EOS stay visible (SentencePiece decodes them to nothing):
    whether the model learns to stop matters."""
    marks = {tokenizer.bos_id: "⟨bos⟩", tokenizer.eos_id: "⟨eos⟩"}
    out, start = [], 0
    for i, token in enumerate(tokens + [None]):
        if token is None or token in marks:
            out.append(tokenizer.decode(tokens[start:i]))
            if token is not None:
                out.append(tokenizer.decode([token]) or marks[token])
            start = i + 1
    return "".join(out)


def render_sample(tokenizer: Tokenizer, inputs: list[int], labels: list[int], color: bool) -> str:
    """The sample's tokens as text, the non-label runs marked. Token j (j >= 1) is learned when
    the label of position j - 1 is valid; the first token is always context."""
    tokens = inputs + ([labels[-1]] if labels[-1] != IGNORE_INDEX else [])
    learned = [False] + [label != IGNORE_INDEX for label in labels[: len(tokens) - 1]]
    padding = 0
    while padding < len(tokens) - 1 and tokens[-1 - padding] == tokenizer.pad_id and not learned[-1 - padding]:
        padding += 1
    tokens, learned = tokens[: len(tokens) - padding], learned[: len(learned) - padding]
    out, start = [], 0
    for end in range(1, len(tokens) + 1):
        if end == len(tokens) or learned[end] != learned[start]:
            text = decode_visibly(tokenizer, tokens[start:end])
            out.append(text if learned[start] else (f"{DIM}{text}{RESET}" if color else f"⟦{text}⟧"))
            start = end
    if padding:
        out.append(f"⟨pad × {padding}⟩")
    return "".join(out)


def mesh_world_size(config: JobConfig) -> int:
    """The world size the config's mesh describes (an unset ``dp_shard`` counts as 1): the batch a
    step trains on does not depend on it, but the plan checks the mesh against it."""
    p = config.parallelism
    world = p.data_parallel_replicate_degree * max(p.data_parallel_shard_degree, 1)
    return world * p.context_parallel_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True)
    parser.add_argument("--step", type=int, required=True, help="training step, counted from 1 as the logs do")
    parser.add_argument("--samples", type=int, default=8, help="how many of the step's samples to print (default 8)")
    ours, training_argv = parser.parse_known_args(argv)
    try:
        if ours.step < 1:
            raise ConfigError(f"--step must be >= 1 (the first step is 1), got {ours.step}.")
        prepared = prepare(training_argv, mesh_world_size(load_config(training_argv)), local_ranks=1, memory=False)
    except UserError as e:
        return report(e, program="show_batch")
    job, dataset, config = prepared.plan, prepared.dataset, prepared.plan.config
    seed, size = config.debug.seed, job.global_batch_size
    indices = global_order(dataset, size, seed).batch(ours.step - 1)
    color = sys.stdout.isatty()
    per_microbatch = config.training.local_batch_size * job.dims.dp
    print(f"step {ours.step}: {size} samples; data: {describe_data(job.config, job.global_batch_size, dataset)}")
    shown = indices[: max(0, ours.samples)]
    width = int(math.log10(max(1, size))) + 1
    for position, index in enumerate(shown):
        inputs, labels = dataset[index]
        micro, within = divmod(position, per_microbatch)
        where = f"micro-batch {micro + 1}, data-parallel rank {within // config.training.local_batch_size}"
        member = f" of {dataset.member_of(index)}" if hasattr(dataset, "member_of") else ""
        valid = int((labels != IGNORE_INDEX).sum())
        print(f"\n--- sample {position + 1:>{width}}/{size}: #{index}{member} ({where}), {valid} label tokens ---")
        print(render_sample(job.tokenizer, inputs.tolist(), labels.tolist(), color))
    if len(shown) < size:
        print(f"\n({len(shown)} of {size} samples shown; --samples {size} shows all)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
