"""What a Mixture-of-Experts job cannot do yet beyond the parallelisms' own refusals, and the
settings a job's layout would ignore: refused before any process group exists, naming the key,
so that a plan never prints as assumed what the run does not do (``resolve_job`` calls these)."""

from __future__ import annotations

from parallelisms.parallel_dims import ParallelDims
from trainer.config import ConfigError, JobConfig
from trainer.model.llama3 import ModelArgs
from trainer.model.moe import MoEArgs


def check_experts(config: JobConfig, dims: ParallelDims, args: ModelArgs, imbalance: float = 1.0) -> None:
    """What a Mixture-of-Experts run does not do yet, beyond the parallelisms' own refusals; and
    the settings that would change nothing in this job's layout, refused rather than ignored
    (``checks_not_applying``)."""
    checks_not_applying(config, dims, args, imbalance)
    if not isinstance(args, MoEArgs):
        return
    if imbalance > dims.ep:
        raise ConfigError(
            f"--target.routing_imbalance {imbalance:g}: the busiest of `parallelism.expert_parallel_degree` = "
            f"{dims.ep} ranks receives at most {dims.ep}x the average tokens; state at most {dims.ep}."
        )
    moe = config.moe
    if moe.balance_loss_weight > 0 and moe.balance_loss_scope == "sequence" and dims.cp * dims.tp > 1:
        raise ConfigError(
            '`moe.balance_loss_scope` = "sequence" needs whole sequences on a rank, but '
            f"`parallelism.context_parallel_degree` x `parallelism.tensor_parallel_degree` = {dims.cp} x {dims.tp} "
            'splits each one; use "global_batch" (exact on every mesh) or "micro_batch".'
        )


def checks_not_applying(config: JobConfig, dims: ParallelDims, args: ModelArgs, imbalance: float) -> None:
    """What this job's model ignores is refused, naming why, so that a plan never prints as
    assumed what the run does not do: ``--target.routing_imbalance`` on a dense model, a
    Mixture-of-Experts whose blocks are all dense, and an imbalance at ``ep`` 1 (one rank holds
    every expert and receives every routed token, however skewed). The settings that need another
    one (``[moe]`` on a dense model among them) are refused as the config loads
    (``trainer/config/dependent_settings.py``)."""
    if not isinstance(args, MoEArgs):
        if imbalance > 1:
            raise ConfigError(
                f"--target.routing_imbalance {imbalance:g} sizes the busiest expert-parallel rank, but `model.name` = "
                f"{config.model.name!r} is dense and routes no token: it would change nothing; drop it."
            )
        return
    if args.n_layers <= args.n_dense_layers:
        raise ConfigError(
            f"`model.n_layers` = {args.n_layers} keeps only {config.model.flavor}'s first {args.n_dense_layers} "
            "block(s), which are dense: the model has no MoE layer to route, balance or split over "
            f"`parallelism.expert_parallel_degree`. Use more than {args.n_dense_layers} layers, or `model.name` = "
            '"llama3" for a dense model.'
        )
    if imbalance > 1 and dims.ep == 1:
        raise ConfigError(
            f"--target.routing_imbalance {imbalance:g} sizes the busiest expert-parallel rank, but at "
            "`parallelism.expert_parallel_degree` = 1 one rank holds every expert and receives every routed "
            "token however skewed the routing is: it would change nothing; drop it, or plan with ep > 1."
        )
