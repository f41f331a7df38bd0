"""The documentation holds together: README's index names every page of docs/, BENCHMARKS.md stays a short
reference whose sections carry their command, machine, date and commit and link every lab notebook of docs/lab/,
and the code blocks docs/ARCHITECTURE.md and docs/RECOVERY.md give run as pasted and print what they say."""

from __future__ import annotations

import re

import pytest
from doc_blocks import ROOT, blocks, quoted_lines, run, same_line, text_blocks

DOCS = ROOT / "docs"
README = ROOT / "README.md"
BENCHMARKS = DOCS / "BENCHMARKS.md"
MAX_BENCHMARKS_LINES = 400
RUN_BLOCKS = [b for page in ("ARCHITECTURE.md", "RECOVERY.md") for b in blocks(DOCS / page)]


def _index() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Documentation\n"):].split("\n## ", 1)[0]
    return re.findall(r"^- (docs/[\w/.-]+\.md):", section, flags=re.M)


def test_readme_index_lists_every_page_of_docs_once():
    pages = sorted(f"docs/{p.name}" for p in DOCS.glob("*.md"))
    listed = _index()
    assert sorted(listed) == pages, f"missing from README's index: {sorted(set(pages) - set(listed))}; " \
                                    f"listed but absent: {sorted(set(listed) - set(pages))}"
    assert len(listed) == len(set(listed))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_benchmarks_is_a_short_reference_linking_every_lab_notebook():
    text = BENCHMARKS.read_text()
    assert len(text.splitlines()) <= MAX_BENCHMARKS_LINES
    links = re.findall(r"\]\(([^)#]+)\)", text)
    for link in links:
        assert (BENCHMARKS.parent / link).exists(), link
    notebooks = sorted(p.name for p in (DOCS / "lab").glob("*.md"))
    linked = {link.removeprefix("lab/") for link in links if link.startswith("lab/") and link.endswith(".md")}
    assert notebooks and sorted(linked) == notebooks
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    for anchor in re.findall(r"\]\(#([^)]+)\)", text):
        assert anchor in anchors, anchor


@pytest.mark.parametrize("title, body", [(t, b) for t, b in _sections(BENCHMARKS.read_text()).items()
                                         if t not in ("At a glance", "Where the old sections went")])
def test_every_benchmarks_section_names_its_command_and_machine(title, body):
    assert re.search(r"(`|^    )(\w+=\S+ |/usr/bin/time -v )*(python|bash) ", body, flags=re.M), title
    assert "CPU dev box" in body or "H200" in body, title
    if not title.startswith("GPU speed"):  # the one section without a measurement of its own
        assert re.search(r"\b2026-\d\d-\d\d\b", body) and re.search(r"commit\s+[0-9a-f]{7}\b", body), title


def test_lab_notebooks_link_back_and_their_pictures_exist():
    for page in (DOCS / "lab").glob("*.md"):
        text = page.read_text()
        assert "](../BENCHMARKS.md)" in text, page.name
        for link in re.findall(r"\]\(([^)#]+)\)", text):
            assert (page.parent / link).exists(), (page.name, link)


def test_callbacks_page_quotes_the_report_levels_and_the_probe_arithmetics():
    from stable_attn.numerics.probe import ARITHMETICS
    from stable_attn.report.plots import LEVELS

    (sat,), (floor, alarm) = ([v for v, _ in LEVELS[stat]] for stat in ("saturation", "max_logit"))
    text = " ".join((DOCS / "CALLBACKS.md").read_text().split())
    assert f"early-warning detectors' levels drawn (saturation {sat:g}; max logit {floor:g} and {alarm:g})" in text
    said = re.search(r"`--arithmetic h100` \(or ([^)]*)\)", text)
    assert said and {"h100", *re.findall(r"`(\w+)`", said.group(1))} == set(ARITHMETICS)


def test_callbacks_page_names_exactly_the_statistics_the_early_warnings_watch():
    """CALLBACKS.md says which per-layer statistics alert (the early-warning detectors' inputs) and that the sink
    mass does not: a detector added on another statistic, or one removed, makes it false."""
    from stable_attn.monitor.layer_watch import _SURGES

    watched = {name for name, _ in _SURGES}
    assert watched == {"saturation", "max_logit", "entropy"}, f"update docs/CALLBACKS.md's detector sentence: {watched}"
    text = " ".join((DOCS / "CALLBACKS.md").read_text().split())
    assert "warns early on max-logit and saturation surges and on attention-entropy collapse" in text
    assert "the sink mass is logged and shown in each alert's evidence, but no detector alerts on it" in text
    readme = " ".join((DOCS.parent / "README.md").read_text().split()).lower()
    assert "sink mass" not in readme.split("detects", 1)[1].split(".", 1)[0]  # README's detection sentence


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.id for b in RUN_BLOCKS])
def test_every_python_block_of_the_pages_runs_and_prints_what_it_says(block, tmp_path, monkeypatch, caplog, capsys):
    import torch

    ran = run(block, tmp_path, monkeypatch, caplog, capsys)
    scope = ran.scope
    if "set_attn_implementation" in block.code:  # the switch the docs give for generating with sdpa, both ways
        assert scope["model"].config._attn_implementation == "stable_attn"
        scope["model"].set_attn_implementation("sdpa")
        assert scope["model"].config._attn_implementation == "sdpa"
    if "patch_sdpa()" in block.code:  # served inside the block, put back after it
        assert not hasattr(torch.nn.functional.scaled_dot_product_attention, "stable_attn_patch")
        assert scope["y"].shape == scope["x"].shape
    if 'on_spike="recover"' in block.code:  # README quotes this block's spike alert as "an alert line"
        (alert,) = quoted_lines(text_blocks(README, "## What you will see")[1])
        assert any(same_line(alert, m) for m in ran.logs), (alert, [m for m in ran.logs if "spike at" in m])
