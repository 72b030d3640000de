"""Every figure the pages quote is read back from its source by the marker beside it
(tests/figures.py: the registry and the marker rule; tests/figures_gpu.py: the GPU cards')."""
from __future__ import annotations

import functools

import pytest

import tests.figures_gpu  # noqa: F401 - registers the GPU cards' figures
import tests.figures_scale  # noqa: F401 - registers the control-plane rehearsal's
from tests._mp import REPO
from tests.figures import (
    GROUPS,
    PAGES,
    Marker,
    MarkerError,
    group_name,
    parse_markers,
    registry,
    values,
)

# --- the tests ----------------------------------------------------------------------------------

@functools.cache
def markers() -> tuple[Marker, ...]:
    return tuple(m for page in PAGES for m in parse_markers((REPO / page).read_text(), page))


@pytest.mark.parametrize("group", [fn for _, fn in GROUPS],
                         ids=[group_name(fn) for _, fn in GROUPS])
def test_each_source_gives_its_figures(group):
    """Each registered function reads its source and passes its own checks, and returns names
    that can be markers and values that can be read back as one token."""
    assert values(group), "a source with no figures"


def check(found: list[Marker], reg: dict[str, tuple[str, str]]) -> list[str]:
    """One line per marker that names no registered figure or follows a token other than the
    registry's value: the page, the line, the marker, the token, the value and its source."""
    wrong = []
    for m in found:
        where = f"{m.page}:{m.line}: <!--fig {m.name}-->"
        if m.name not in reg:
            wrong.append(f"{where} names no registered figure (token {m.token!r})")
        elif reg[m.name][0] != m.token:
            value, source = reg[m.name]
            wrong.append(f"{where} follows {m.token!r}; {source} gives {value!r}")
    return wrong


@pytest.mark.parametrize("page", PAGES)
def test_every_marker_reads_its_figure(page):
    """Every marker in the page names a registered figure, and the token before it is the
    registry's value."""
    wrong = check([m for m in markers() if m.page == page], registry())
    assert not wrong, "\n".join(wrong)


def test_every_figure_is_quoted():
    """A registered figure that no page marks is a figure dropped from the docs (or a registry
    line that outlived its figure)."""
    quoted = {m.name for m in markers()}
    missing = [f"{name} = {value!r} ({source})" for name, (value, source) in registry().items()
               if name not in quoted]
    assert not missing, "registered, quoted nowhere:\n" + "\n".join(missing)


def test_the_marker_rule():
    """The token before each marker, on hand-written lines: emphasis and code skipped, a table
    cell, a percent, a ratio, each end of a range, a unit number without its ``#``; a comma
    typed before the marker is part of the token (so it fails against the registry); markers in
    code are not markers; a marker with no token and a malformed one are errors."""
    text = "\n".join([
        "validation BPC **2.398**<!--fig demo.val_bpc--> for the LM",
        "| mLSTM fused/triton | 256 | 928,020<!--fig a.chars_per_s--> | 61.2%<!--fig a.peak--> |",
        "trained by `--time-limit 349s`<!--fig b.limit--> and 1.113x<!--fig b.x-->,",
        "range 244<!--fig c.lo-->-290<!--fig c.hi--> us, unit #3774<!--fig c.unit-->.",
        "fell from 1.678,<!--fig d.misplaced--> 1.575 to 1.475<!--fig d.last-->.",
        "shown as code: `<!--fig not.a.marker-->`, and in a fence:",
        "```",
        "x <!--fig nor.this-->",
        "```",
    ])
    assert [(m.line, m.name, m.token) for m in parse_markers(text)] == [
        (1, "demo.val_bpc", "2.398"), (2, "a.chars_per_s", "928,020"), (2, "a.peak", "61.2%"),
        (3, "b.limit", "349s"), (3, "b.x", "1.113x"), (4, "c.lo", "244"), (4, "c.hi", "290"),
        (4, "c.unit", "3774"), (5, "d.misplaced", "1.678,"), (5, "d.last", "1.475")]
    for bad, why in (("the figure <!--fig x.y--> after a space", "no figure token"),
                     ("| <!--fig x.y--> |", "no figure token"),
                     ("twice 2.0<!--fig x.y--><!--fig x.z-->", "no figure token"),
                     ("dots ...<!--fig x.y-->", "no figure token"),
                     ("2.0<!--fig x y-->", "malformed"), ("2.0<!--fig x.-->", "malformed"),
                     ("2.0<!-- fig x.y -->", "malformed")):
        with pytest.raises(MarkerError, match=why):
            parse_markers(bad, "page.md")


def test_a_wrong_token_names_page_line_marker_token_value_and_source():
    text = "intro\nBPC **2.399**<!--fig x.bpc--> and 7.0<!--fig x.gone-->, 12<!--fig x.n-->\n"
    reg = {"x.bpc": ("2.398", "docs/results/x.json"), "x.n": ("12", "docs/results/x.json")}
    assert check(parse_markers(text, "docs/x.md"), reg) == [
        "docs/x.md:2: <!--fig x.bpc--> follows '2.399'; docs/results/x.json gives '2.398'",
        "docs/x.md:2: <!--fig x.gone--> names no registered figure (token '7.0')"]

