"""A compiled Mixture-of-Experts (per-block ``torch.compile``) trains as the eager 1-process run
does, over several steps with accumulation, recompute, expert and pipeline parallelism: losses,
grad norms, balancing loss, biases and tokens per expert at 5e-5. The routing's data-dependent
parts (the per-expert loop's splits, the all-to-all's sizes) run eagerly inside the compiled
blocks, and a recomputation inside compiled code still counts nothing: the injected double
count fails the comparison.

Inductor generates the kernels of the 1-rank run; the meshes run the same graphs through
``aot_eager`` (``compile.backend``: AOTAutograd's functionalisation, partitioning and
recomputation, eager kernels), which compiles about 4x faster on this CPU: what a mesh adds to
a compiled block (the exchanges, the stages, TP's DTensors) is in the graphs, not the kernels.
TP's collectives under Inductor's kernels run in ``test_activation_checkpoint_compile.py``."""

from __future__ import annotations

import pytest
from moe_helpers import TOLERANCE, differences, launch_moe

COMPILE = ["--compile.enable"]
GRAPHS = [*COMPILE, "--compile.backend", "aot_eager"]
RECOMPUTE = ["--activation_checkpoint.mode", "full"]
# name: (world size, local batch size, extra argv); global batch 8
MESHES = {
    "compiled, 2 micro-batches": (1, 4, COMPILE),
    "compiled, per-op selective recompute": (1, 4, [*GRAPHS, "--activation_checkpoint.mode", "selective"]),
    "compiled, ep=2, full recompute": (2, 2, ["--mesh", "dp_shard=2,ep=2", *GRAPHS, *RECOMPUTE]),
    "compiled, pp=2 1F1B": (2, 4, ["--mesh", "pp=2", *GRAPHS]),
    # torch.compile of the loss under loss parallel is refused: the model alone.
    "compiled, tp=2 x ep=2": (4, 4, ["--mesh", "dp_shard=2,tp=2,ep=2", *GRAPHS, "--compile.components", "model"]),
}
# On the mesh whose correct run is compared above: only the double count can make it differ.
BUGS = {"tokens counted again in recompute": MESHES["compiled, ep=2, full recompute"]}


@pytest.fixture(scope="module")
def launched() -> dict[str, list]:
    return launch_moe(MESHES, BUGS)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_compiled_moe_matches_eager(mesh, launched):
    ref = launched["reference"][0]
    for rank_result in launched[mesh]:
        print(mesh, {k: f"{v:.1e}" for k, v in differences(rank_result, ref).items()})
        assert rank_result["n"] == ref["n"]
        assert max(differences(rank_result, ref).values()) < TOLERANCE, differences(rank_result, ref)


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(BUGS))
def test_injected_bug_is_caught_in_compiled_code(bug, launched):
    ref, result = launched["reference"][0], launched[f"bug: {bug}"][0]
    print(bug, {k: f"{v:.1e}" for k, v in differences(result, ref).items()})
    assert max(differences(result, ref).values()) > 10 * TOLERANCE, differences(result, ref)
