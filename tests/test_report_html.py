"""report.html: one self-contained page of a simulation, checked on real runs."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.services.scheduler.simulation.report import PLOT_FILES, human_duration
from gpusched.services.scheduler.simulation.report_html import REPORT_FILE, Option, RunInfo, render

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("fifo", "sjf", "tiresias")


@dataclass
class Page(HTMLParser):
    """What a browser would see: the tags, the results rows, images and text."""

    tags: list[str] = field(default_factory=list)
    #: policy -> [(data-value or None, text)] of its results row, header cell first
    rows: dict[str, list[tuple[str | None, str]]] = field(default_factory=dict)
    #: setting name -> (value, source)
    settings: dict[str, tuple[str, str]] = field(default_factory=dict)
    images: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: every src or href that is not a data: URI
    external: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    _row: list[tuple[str | None, str]] | None = None
    _cell: tuple[str | None, list[str]] | None = None
    _table: str = ""
    _in_note: bool = False

    def __post_init__(self) -> None:
        super().__init__(convert_charrefs=True)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        attr = dict(attrs)
        for name in ("src", "href"):
            link = attr.get(name)
            if link is not None and not link.startswith("data:"):
                self.external.append(link)
        if tag == "table":
            self._table = attr.get("class") or ""
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = (attr.get("data-value"), [])
        elif tag == "img":
            self.images.append(attr.get("src") or "")
        elif tag == "li":
            self._in_note = True
            self.notes.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append((self._cell[0], "".join(self._cell[1])))
            self._cell = None
        elif tag == "tr" and self._row:
            cells, self._row = self._row, None
            name = cells[0][1]
            if self._table == "results" and name != "policy":
                self.rows[name] = cells
            elif self._table == "settings" and name != "setting":
                self.settings[name] = (cells[1][1], cells[2][1])
        elif tag == "li":
            self._in_note = False

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._cell is not None:
            self._cell[1].append(data)
        if self._in_note:
            self.notes[-1] += data


def parse(html: str) -> Page:
    page = Page()
    page.feed(html)
    page.close()
    return page


def run_simulate(tmp_path: Path, *args: str) -> tuple[str, Path]:
    """``gpusched simulate`` as a program; its printed output and its --out folder."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "gpusched.services.cli.main", "simulate", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"},
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr, out


def test_a_simulation_writes_a_report_with_its_table_plots_settings_and_trace_notes(
    tmp_path: Path,
):
    output, out = run_simulate(
        tmp_path, "--trace", "synthetic:50", "--cluster", "2x4", "-p", ",".join(POLICIES),
        "--seed", "7", "--restart-overhead", "45",
    )  # fmt: skip
    html = (out / REPORT_FILE).read_text(encoding="utf-8")
    page = parse(html)
    summary = json.loads((out / "summary.json").read_text())["policies"]

    assert set(page.rows) == set(summary) == set(POLICIES)
    printed = {line.split()[0]: " ".join(line.split()) for line in output.splitlines()
               if line.split() and line.split()[0] in POLICIES}  # fmt: skip
    for policy, cells in page.rows.items():
        avg_value, avg_text = cells[2]
        assert avg_value is not None and float(avg_value) == summary[policy]["avg_jct_s"]
        assert avg_text == human_duration(summary[policy]["avg_jct_s"])
        assert float(cells[1][0] or "nan") == summary[policy]["jobs"] == 50
        # the very cells the command printed, in its order
        assert " ".join(text for _, text in cells) == printed[policy]

    assert len(page.images) == len(PLOT_FILES)
    embedded = {base64.b64decode(src.removeprefix("data:image/png;base64,"))
                for src in page.images}  # fmt: skip
    assert embedded == {(out / name).read_bytes() for name in PLOT_FILES.values()}
    assert page.external == [] and "script" not in page.tags and "link" not in page.tags

    assert page.settings["--trace"] == ("synthetic:50", "given")
    assert page.settings["--seed"] == ("7", "given")
    assert page.settings["--restart-overhead"] == ("45.0", "given")
    assert page.settings["--speed-model"] == ("grid", "default")
    assert page.settings["policies"][0] == ", ".join(POLICIES)
    assert page.settings["cluster"][0].startswith("2 nodes x 4 GPUs")
    assert any(n.startswith("synthetic: 50 jobs") and "seed 7" in n for n in page.notes)
    assert "--trace synthetic:50" in html and "--seed 7" in html  # the command line


def test_a_trace_and_a_job_named_with_markup_show_as_text(tmp_path: Path):
    trace = tmp_path / "<b>&trace.csv"
    trace.write_text(
        "job_id,submit_time,gpus,model,batch_size,duration_s\n"
        "<script>alert(1)</script>,0,1,resnet50,64,600\n"
        "j2,30,2,bert,32,1200\n"
        "bad,row\n"
    )
    _, out = run_simulate(tmp_path, "--trace", str(trace), "--format", "native",
                          "--cluster", "1x4", "-p", "fifo", "--skip-bad-rows")  # fmt: skip
    html = (out / REPORT_FILE).read_text(encoding="utf-8")
    page = parse(html)
    assert "<b>" not in html and "&lt;b&gt;&amp;trace.csv" in html
    assert "b" not in page.tags and "script" not in page.tags
    assert page.settings["--trace"] == (str(trace), "given")
    assert page.settings["--skip-bad-rows"] == ("true", "given")
    assert f"{trace}: 2 jobs" in page.notes
    assert "skipped 1 malformed rows" in page.notes


#: a results table of one policy, as report.summary_cells gives it
_CELLS = ([("policy", "policy"), ("avg\nJCT", "avg_jct_s")], [["fifo", "15 min"]], [True])


@settings(deadline=None, max_examples=200)
@given(st.text(), st.text(min_size=1))
def test_any_note_or_option_value_comes_back_as_the_same_text_and_adds_no_tag(
    note: str, value: str
):
    run = RunInfo(options=(Option("--trace", (value,), given=True),), notes=(note,))
    html = render(_CELLS, {"policies": {"fifo": {"avg_jct_s": 900.0}}}, [], run)
    page = parse(html)
    assert page.notes == [note]
    assert page.settings["--trace"] == (value, "given")
    assert set(page.tags) <= _PAGE_TAGS


#: every tag the page is built from
_PAGE_TAGS = {
    "html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "code", "table",
    "caption", "thead", "tbody", "tr", "th", "td", "strong", "figure", "img",
    "figcaption", "ul", "li", "details", "summary", "pre", "footer",
}  # fmt: skip
