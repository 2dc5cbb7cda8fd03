"""Check in a real browser that every chart of the Custom Scalars dashboard draws (developer tool, not CI).

The layout can be right on paper and still show empty charts: TensorBoard's data endpoint may
return a tag that its chart card then fails to draw (tags with parentheses), or a chart may scale
its y-axis away from its own line (two values and "Ignore outliers in chart scaling"); see
``trainer/metrics/dashboard.py``. Only a browser shows it, so this script trains a short run (or
takes a finished run's dump folder), starts TensorBoard on it on a free localhost port, opens the
Custom Scalars tab in headless Chromium, saves a screenshot and checks every chart the layout
registers:

* over HTTP, the chart's tags (joined as the chart card joins them) return points from
  ``/data/plugin/custom_scalars/scalars``;
* in the page, the chart card has drawn at least one line (an SVG ``path.line`` with a shape), and
  its y-axis was scaled to its values (it shows their median and they fill a tenth of it or more);
* the page shows the charts of each category in the order ``trainer.metrics.dashboard`` lays out.

The run it trains logs two points per series, training and validation, the case the outlier
filter empties. It prints one line per chart, then the order and the page's JavaScript errors,
and exits 1 if any chart is empty or out of order.

Dependencies (optional, not needed to train or test)::

    apt-get install -y chromium chromium-driver   # /usr/bin/chromium, /usr/bin/chromedriver
    pip install selenium

Usage::

    python scripts/check_dashboard.py                          # train 6 steps into a temp folder
    python scripts/check_dashboard.py --dump-folder /tmp/run   # a finished run's job.dump_folder
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a plain script from anywhere

from trainer.metrics.dashboard import DASHBOARD  # noqa: E402

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    # Without these Chromium phones home at start, and this kind of sandboxed machine refuses it.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
]
CARD_ELEMENTS = "tf-custom-scalar-multi-line-chart-card, tf-custom-scalar-margin-chart-card"

# TensorBoard's Polymer elements keep their content in shadow roots, which querySelectorAll
# does not enter.
DEEP_JS = """
const deep = (root, selector, found) => {
  root.querySelectorAll('*').forEach(el => {
    if (el.matches(selector)) found.push(el);
    if (el.shadowRoot) deep(el.shadowRoot, selector, found);
  });
  return found;
};
"""
# Every chart card with its title, the series whose data arrived, the line paths Plottable drew
# (a line with no data has an empty ``d``), and whether the y-axis shows the chart's data: the
# values the chart scales its y-axis by (smoothed when smoothing is on) and the axis range it
# chose. A line can be drawn and still lie outside the axis, where it shows as an empty frame.
CARDS_JS = (
    DEEP_JS
    + """
return deep(document, arguments[0], []).map(card => {
  const chart = (deep(card.shadowRoot || card, 'vz-line-chart2', [])[0] || {})._chart;
  return {
    title: card.title,
    series: (card._seriesNames || []).length,
    drawn: deep(card.shadowRoot || card, 'path.line', [])
      .filter(path => /[0-9]/.test(path.getAttribute('d') || '')).length,
    values: chart ? chart.getValuesForYAxisDomainCompute() : [],
    y_axis: chart ? chart.yScale.domain() : [],
  };
});
"""
)
# The page scrolls inside an element, not the document: how much taller the window must be to
# show it all in one screenshot.
HIDDEN_HEIGHT_JS = (
    DEEP_JS
    + """
return Math.max(0, ...deep(document, '*', []).map(el => el.scrollHeight - el.clientHeight));
"""
)


@dataclass
class Chart:
    """One chart of the registered layout and what the check found for it."""

    category: str
    title: str
    tag_filter: str
    """The regex the chart card sends to the data endpoint."""
    points: dict[str, int]
    drawn: int = 0
    values: list[float] = field(default_factory=list)
    """The values the chart scales its y-axis by (smoothed when smoothing is on)."""
    y_axis: list[float] = field(default_factory=list)
    """The range the chart's y-axis shows."""

    @property
    def fitted(self) -> bool:
        """Whether the y-axis was scaled to the data. With "Ignore outliers in chart scaling" (on by
        default) TensorBoard scales it to the values between the 5th and 95th percentile, padded:
        those hold the median and, unless all are equal, fill much of the axis. An axis that misses
        the median, or on which the data is a flat line at one edge, was not scaled to the data."""
        if not self.values or len(self.y_axis) != 2:
            return False
        low, high = min(self.y_axis), max(self.y_axis)
        if not low <= statistics.median(self.values) <= high:
            return False
        shown = [v for v in self.values if low <= v <= high]
        return max(self.values) == min(self.values) or max(shown) - min(shown) >= (high - low) / 10

    @property
    def ok(self) -> bool:
        return sum(self.points.values()) > 0 and self.drawn > 0 and self.fitted


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(dump_folder: Path) -> None:
    """A 6-step CPU run that logs steps 1 and 6 and validates after steps 3 and 6: two points per series."""
    command = [
        str(REPO_ROOT / "run_train.sh"),
        "--training.steps", "6",
        "--metrics.log_freq", "6",
        "--validation.enable", "true",
        "--validation.freq", "3",
        "--job.dump_folder", str(dump_folder),
    ]  # fmt: skip
    log = dump_folder.parent / f"{dump_folder.name}.train.log"
    print(f"training 6 steps into {dump_folder} (log: {log})", flush=True)
    with log.open("w") as out:
        subprocess.run(command, cwd=REPO_ROOT, env={**os.environ, "NGPU": "1"}, stdout=out, stderr=out, check=True)


def newest_run(dump_folder: Path) -> Path:
    """The folder of the newest TensorBoard events file under ``dump_folder`` (one run)."""
    events = sorted(dump_folder.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    if not events:
        sys.exit(f"no TensorBoard events file under {dump_folder}")
    return events[-1].parent


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def wait_for_layout(base: str, tensorboard: subprocess.Popen[bytes], timeout_s: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if tensorboard.poll() is not None:
            sys.exit(f"TensorBoard exited with {tensorboard.returncode}")
        try:
            layout = get_json(f"{base}/data/plugin/custom_scalars/layout")
            if layout:
                return layout
        except OSError:
            pass
        time.sleep(1)
    sys.exit(f"TensorBoard at {base} served no Custom Scalars layout within {timeout_s:.0f} s")


def tag_filter(chart: dict[str, Any]) -> str:
    """The regex the card requests, built as TensorBoard's chart cards build it."""
    if "multiline" in chart:
        regexes = chart["multiline"]["tag"]
        return regexes[0] if len(regexes) == 1 else "|".join(f"({r})" for r in regexes)
    tags = [s[key] for s in chart["margin"]["series"] for key in ("value", "lower", "upper")]
    return "|".join(f"({re.escape(t)})" for t in tags)


def charts_over_http(base: str, layout: dict[str, Any]) -> list[Chart]:
    runs = get_json(f"{base}/data/runs")
    charts = []
    for category in layout["category"]:
        for chart in category["chart"]:
            regex = tag_filter(chart)
            points: dict[str, int] = {}
            for run in runs:
                query = urllib.parse.urlencode({"tag": regex, "run": run})
                found = get_json(f"{base}/data/plugin/custom_scalars/scalars?{query}")
                for tag, events in found["tag_to_events"].items():
                    points[tag] = points.get(tag, 0) + len(events)
            charts.append(Chart(category["title"], chart["title"], regex, points))
    return charts


def check_in_browser(
    base: str, charts: list[Chart], screenshot: Path, chromium: str, chromedriver: str, timeout_s: float
) -> tuple[list[str], list[str]]:
    """Fill in what the page drew for each chart, save the screenshot; the chart titles in the
    order the page shows them, and the page's JS errors."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="check-dashboard-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(options=options, service=Service(chromedriver))
        try:
            driver.get(f"{base}/#custom_scalars")
            cards = wait_for_cards(driver, len(charts), timeout_s)
            by_title: dict[str, list[dict[str, Any]]] = {}
            for card in cards:
                by_title.setdefault(card["title"], []).append(card)
            for chart in charts:
                if by_title.get(chart.title):
                    card = by_title[chart.title].pop(0)
                    chart.drawn, chart.values, chart.y_axis = card["drawn"], card["values"], card["y_axis"]
            hidden = driver.execute_script(HIDDEN_HEIGHT_JS)
            size = driver.get_window_size()
            driver.set_window_size(size["width"], size["height"] + int(hidden))
            time.sleep(2)
            driver.save_screenshot(str(screenshot))
            errors = [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        finally:
            driver.quit()
    return [card["title"] for card in cards], list(dict.fromkeys(errors))


def wait_for_cards(driver: Any, expected: int, timeout_s: float) -> list[dict[str, Any]]:
    """The cards once every one has its data and the drawing has settled, or at the deadline."""
    deadline = time.monotonic() + timeout_s
    previous: list[dict[str, Any]] = []
    while True:
        cards = driver.execute_script(CARDS_JS, CARD_ELEMENTS)
        loaded = len(cards) >= expected and all(card["series"] for card in cards)
        if (loaded and cards == previous) or time.monotonic() > deadline:
            return cards
        previous = cards
        time.sleep(2)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump-folder", type=Path, help="a finished run's job.dump_folder (default: train one)")
    parser.add_argument("--screenshot", type=Path, help="PNG to write (default: DUMP_FOLDER/dashboard.png)")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--chromedriver", default="/usr/bin/chromedriver")
    parser.add_argument("--timeout", type=float, default=90, help="seconds to wait for the charts to draw")
    args = parser.parse_args(argv)

    dump_folder = args.dump_folder
    if dump_folder is None:
        dump_folder = Path(tempfile.mkdtemp(prefix="check-dashboard-")) / "run"
        train(dump_folder)
    logdir = newest_run(dump_folder)
    screenshot = (args.screenshot or dump_folder / "dashboard.png").resolve()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    print(f"TensorBoard on {logdir} at {base}", flush=True)
    tensorboard = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        charts = charts_over_http(base, wait_for_layout(base, tensorboard))
        shown_order, errors = check_in_browser(base, charts, screenshot, args.chromium, args.chromedriver, args.timeout)
    finally:
        tensorboard.terminate()
        tensorboard.wait()

    titles = {chart.title for chart in charts}
    laid_out = [title for category in DASHBOARD.values() for title in category if title in titles]
    charts.sort(key=lambda chart: laid_out.index(chart.title) if chart.title in laid_out else len(laid_out))
    for chart in charts:
        over_http = ", ".join(f"{tag} {n} points" for tag, n in chart.points.items()) or "no tag matched"
        shown = "y-axis " + " to ".join(f"{v:.4g}" for v in chart.y_axis)
        if chart.values:
            shown += f" for values {min(chart.values):.4g} to {max(chart.values):.4g}"
        print(
            f"{'ok   ' if chart.ok else 'EMPTY'}  {chart.category} / {chart.title}: "
            f"{chart.drawn} line paths drawn, {shown}; HTTP {over_http}"
        )
    in_order = shown_order == laid_out
    print(
        f"{'ok   ' if in_order else 'ORDER'}  charts shown in the order laid out"
        + ("" if in_order else f": {shown_order}")
    )
    for error in errors:
        print(f"page error: {error.splitlines()[0]}")
    empty = sum(not chart.ok for chart in charts)
    print(f"{len(charts) - empty}/{len(charts)} charts draw; screenshot: {screenshot}")
    return 1 if empty or not in_order else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
