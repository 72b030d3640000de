"""The control-plane rehearsal's model (benchmarks/control_plane.py) against the figures issue #61
measured on the code before it: what scaled with the world size, and what does now."""
from __future__ import annotations

import pytest

from benchmarks.control_plane import model


def test_the_model_gives_the_measured_figures_before_and_flat_ones_now():
    m128, m1024 = model(128), model(1024)
    assert m128["sent_per_rank"] == 1 << 20  # "H=4096, B=32: ~1 MiB per rank"
    assert m128["received_per_rank_before"] == 128 << 20  # "128 MiB at 128 ranks"
    assert m1024["received_per_rank_before"] == 1 << 30  # "1 GiB at 1024"
    assert m128["probe_connections_before"] == 16_256  # "16K connects at 128 ranks"
    # "~44 GB per checkpoint at 128 ranks" of 1-bit error buffers (4 B x 86M params x 129)
    assert m128["file_bytes_before_onebit"] - m128["file_bytes_now"] == pytest.approx(44.4e9,
                                                                                      rel=0.01)
    # now: a rank but 0 receives nothing and reads its rows; probes and stop lines go with the
    # hosts (16 and 128 of 8 ranks), not the ranks squared or the ranks
    assert m128["received_other_rank_now"] == m1024["received_other_rank_now"] == 0
    assert m128["resume_read_other_rank_now"] == m1024["resume_read_other_rank_now"] == 1 << 20
    assert (m128["probe_connections_now"], m1024["probe_connections_now"]) == (240, 1920)
    assert m128["probes_per_prober_now"] == m1024["probes_per_prober_now"] == 15
    assert (m128["stop_lines_now"], m1024["stop_lines_now"]) == (17, 129)
