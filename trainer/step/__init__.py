"""One training step and what it is made of: the schedule of its forwards and backwards, its parts
(the gradient accumulator that normalises the loss, the gradients' reduction, MoE balancing, the
replica groups' commit, the optimizer step), and the one owner of its sums over ranks."""
