r"""What TensorBoard gets: the scalar tags, and the Custom Scalars layout that charts them.

Tags are torchtitan's, so runs of the two compare tag by tag. Two habits of TensorBoard's chart
cards decide how the layout is written; neither shows in the events file, only in a browser
(``scripts/check_dashboard.py`` checks every chart there).

**Parentheses.** Eight tags carry a unit in parentheses (``throughput(tps)``, ``mfu(%)``,
``memory/max_active(GiB)``, ...). A chart card names each series ``"<tag> (<run>)"`` and reads the
run back, for the series colour, with the regex ``/\((.*)\)$/``, whose greedy group starts at the
tag's own ``(``. The colour scale throws "String tps) (. was not in the domain." and the chart
stays empty although its data arrived ("Matches (1)"). No layout can avoid that, because the
series name is built from the tag itself. So each of those tags is also written under an alias
without parentheses in the ``dashboard/`` group (:data:`DASHBOARD_ALIASES`), and the layout charts
the aliases. The Scalars tab shows both; the torchtitan names stay the ones to compare runs by.

**Two values.** With "Ignore outliers in chart scaling" (on by default) a chart scales its y-axis
to the values between their 5th and 95th percentile. Of two different values neither lies
between them, so the axis falls back to 0 to 1 and the line lies outside it: a chart whose series
hold two values in all (validation every ``validation.freq`` steps evaluated twice, a run that
logs only its first and last step, two runs of one point each) is an empty frame. A multi-line
chart gives the scale one value per point (smoothed or not); a margin chart gives it three, the
value and both ends of its band. So every chart is a margin chart whose band is the line itself
(``lower`` and ``upper`` are the value's own tag): any number of points gives the scale three
values or more, of which those between the percentiles are never none. Its lines are not smoothed;
the Time Series and Scalars tabs smooth every tag.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from trainer.step.sums import Logged

if TYPE_CHECKING:
    from tensorboard.compat.proto.summary_pb2 import Summary


class Tag:
    """The TensorBoard tags the metrics logger writes."""

    LOSS_AVG = "loss_metrics/global_avg_loss"
    LOSS_MAX = "loss_metrics/global_max_loss"
    GRAD_NORM = "grad_norm"
    LR = "lr"
    VALID_TOKENS = "n_valid_tokens"
    TOKENS_SEEN = "n_tokens_seen"
    TPS = "throughput(tps)"
    TFLOPS = "tflops"
    MFU = "mfu(%)"
    MEM_ACTIVE = "memory/max_active(GiB)"
    MEM_RESERVED = "memory/max_reserved(GiB)"
    MEM_ACTIVE_PCT = "memory/max_active(%)"
    MEM_RESERVED_PCT = "memory/max_reserved(%)"
    ALLOC_RETRIES = "memory/num_alloc_retries"
    OOMS = "memory/num_ooms"
    STEP_TIME = "time_metrics/end_to_end(s)"
    DATA_PCT = "time_metrics/data_loading(%)"
    SKIPPED = "n_skipped_steps"
    VAL_LOSS = "validation/loss"
    VAL_PERPLEXITY = "validation/perplexity"
    VAL_TIME = "validation/seconds"


DASHBOARD_ALIASES: dict[str, str] = {
    Tag.TPS: "dashboard/throughput_tps",
    Tag.MFU: "dashboard/mfu_pct",
    Tag.MEM_ACTIVE: "dashboard/memory_max_active_GiB",
    Tag.MEM_RESERVED: "dashboard/memory_max_reserved_GiB",
    Tag.MEM_ACTIVE_PCT: "dashboard/memory_max_active_pct",
    Tag.MEM_RESERVED_PCT: "dashboard/memory_max_reserved_pct",
    Tag.STEP_TIME: "dashboard/end_to_end_s",
    Tag.DATA_PCT: "dashboard/data_loading_pct",
}
"""torchtitan tag -> the copy the Custom Scalars layout charts (see the module docstring)."""

DASHBOARD: dict[str, dict[str, tuple[str, ...]]] = {
    "loss": {"loss": (Tag.LOSS_AVG, Tag.LOSS_MAX)},
    "optimizer": {
        "grad norm": (Tag.GRAD_NORM,),
        "learning rate": (Tag.LR,),
        "skipped steps": (Tag.SKIPPED,),
    },
    "throughput": {
        "tokens/s per device": (Tag.TPS,),
        "TFLOP/s": (Tag.TFLOPS,),
        "MFU %": (Tag.MFU,),
    },
    "memory": {
        "peak memory (GiB)": (Tag.MEM_ACTIVE, Tag.MEM_RESERVED),
        "peak memory (% of device)": (Tag.MEM_ACTIVE_PCT, Tag.MEM_RESERVED_PCT),
        "allocator retries and OOMs": (Tag.ALLOC_RETRIES, Tag.OOMS),
    },
    "validation": {
        "training and validation loss": (Tag.LOSS_AVG, Tag.VAL_LOSS),
        "validation perplexity": (Tag.VAL_PERPLEXITY,),
        "validation time (s)": (Tag.VAL_TIME,),
    },
    "data": {
        "tokens": (Tag.TOKENS_SEEN,),
        "valid tokens per step": (Tag.VALID_TOKENS,),
        "step time (s)": (Tag.STEP_TIME,),
        "data loading %": (Tag.DATA_PCT,),
    },
}
"""Categories and charts of the Custom Scalars tab, by torchtitan tag; the step's declared values
(``trainer.step.sums.Logged``) add theirs after them."""


def written_tags(*, mfu: bool, cuda: bool, validation: bool) -> set[str]:
    """The core tags the logger writes (the step's declared values add theirs): MFU needs a
    peak, the rest of memory CUDA, validation its own."""
    tags = {
        Tag.LOSS_AVG,
        Tag.LOSS_MAX,
        Tag.GRAD_NORM,
        Tag.LR,
        Tag.VALID_TOKENS,
        Tag.TOKENS_SEEN,
        Tag.TPS,
        Tag.TFLOPS,
        Tag.MEM_ACTIVE,
        Tag.STEP_TIME,
        Tag.DATA_PCT,
        Tag.SKIPPED,
    }
    if mfu:
        tags.add(Tag.MFU)
    if validation:
        tags |= {Tag.VAL_LOSS, Tag.VAL_PERPLEXITY, Tag.VAL_TIME}
    if cuda:
        tags |= {Tag.MEM_RESERVED, Tag.MEM_ACTIVE_PCT, Tag.MEM_RESERVED_PCT, Tag.ALLOC_RETRIES, Tag.OOMS}
    return tags


def charts(written: set[str], logged: Sequence[Logged] = ()) -> dict[str, dict[str, tuple[str, ...]]]:
    """:data:`DASHBOARD`'s charts of written tags, then the declared values' charts in the order
    of their declarations, by category."""
    laid_out = {category: dict(charts) for category, charts in DASHBOARD.items()}
    for d in logged:
        if d.chart:
            category, _, title = d.chart.partition("/")
            chart = laid_out.setdefault(category, {})
            chart[title] = (*chart.get(title, ()), d.tag)
            written = written | {d.tag}
    return {
        category: {title: shown for title, tags in charts.items() if (shown := tuple(t for t in tags if t in written))}
        for category, charts in laid_out.items()
    }


def layout_summary(written: set[str], logged: Sequence[Logged] = ()) -> Summary:
    """The Custom Scalars layout, as the summary TensorBoard reads it from the events file.

    Only written tags are charted, so no chart stays empty on CPU (no MFU, reserved memory,
    percentages or allocator counts there), and a chart or category left with no tag is dropped;
    the validation category needs validation, since its loss chart would only repeat the training
    loss. Every chart is a margin chart whose band is its own line (see the module docstring).
    The charts of a category show in :func:`charts`'s order.
    """
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.custom_scalar import layout_pb2

    categories = []
    for category, laid_out in charts(written, logged).items():
        if category == "validation" and Tag.VAL_LOSS not in written:
            continue
        shown = []
        for title, tags in laid_out.items():
            series = [
                layout_pb2.MarginChartContent.Series(value=alias, lower=alias, upper=alias)
                for alias in (DASHBOARD_ALIASES.get(t, t) for t in tags)
            ]
            if series:
                shown.append(layout_pb2.Chart(title=title, margin=layout_pb2.MarginChartContent(series=series)))
        if shown:
            # TensorBoard's category view inserts the i-th chart before its i-th child element, but
            # each chart stamps two (a multi-line and a margin template): margin charts come out
            # last first, so they are written last first.
            categories.append(layout_pb2.Category(title=category, chart=shown[::-1]))
    layout = layout_pb2.Layout(category=categories)
    tensor = TensorProto(dtype="DT_STRING", string_val=[layout.SerializeToString()], tensor_shape=TensorShapeProto())
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="custom_scalars"))
    return Summary(value=[Summary.Value(tag="custom_scalars__config__", tensor=tensor, metadata=metadata)])
