"""The README's benchmark figures are the committed results (issue 11 goal 5): the
table between the `bench-figures` markers is exactly what bench/report.py renders from
bench/results/*.json, and no results file is left there that the README does not name."""

from __future__ import annotations

from bench import report


def test_the_readme_figures_are_rendered_from_the_results_files():
    assert report.readme_block(report.README.read_text()) == report.render(), \
        "README.md's benchmark figures are stale: run `python -m bench.report`"


def test_every_results_file_is_named_in_the_readme():
    text = report.README.read_text()
    assert [p.name for p in sorted(report.RESULTS.glob("*.json")) if p.name not in text] == []
