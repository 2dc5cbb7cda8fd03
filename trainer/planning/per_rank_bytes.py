"""A memory estimate's result: one rank's bytes by part, its expected peak and its one-line account."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.hardware import gib


@dataclass(frozen=True)
class Estimate:
    """Per-rank bytes by part; :attr:`total` is the expected peak. Under pipeline parallelism,
    those of ``pp_rank``, the rank that needs the most."""

    model_state: int
    fsdp_buffers: int
    activations: int
    logits: int
    allocator: int
    runtime: int
    pp_rank: int | None = None
    """The pipeline rank (None without pipeline parallelism)."""
    params: int = 0
    """Parameters of the model this rank's stages hold, before sharding (all of them without pipelining)."""
    optimizer: int = 0
    """What Muon's optimizer step holds beside the model state (0 with AdamW)."""

    @property
    def total(self) -> int:
        step = self.model_state + self.fsdp_buffers + self.activations + self.logits + self.allocator + self.runtime
        return max(step, self.model_state + self.optimizer + self.runtime)

    def line(self) -> str:
        parts = (
            ("params+grads+AdamW", self.model_state),
            ("FSDP buffers", self.fsdp_buffers),
            ("activations", self.activations),
            ("logits", self.logits),
            ("allocator slack", self.allocator),
            ("runtime", self.runtime),
        )
        where = f" (pipeline rank {self.pp_rank}, the largest)" if self.pp_rank is not None else ""
        muon = f"; Muon's optimizer step holds {gib(self.optimizer)} beside the model state" if self.optimizer else ""
        return f"{gib(self.total)} per rank{where} = " + " + ".join(f"{gib(b)} {name}" for name, b in parts) + muon
