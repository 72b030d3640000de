"""Figures of the control-plane rehearsal (benchmarks/control_plane.py), registered beside
tests/figures.py's (tests/test_figures.py imports this module)."""
from __future__ import annotations

from tests.figures import figures, load


@figures("docs/results/control_plane.json")
def control_plane() -> dict[str, str]:
    """``python -m benchmarks.control_plane``'s rehearsal (N CPU ranks under each launcher): the
    checkpoint at 1 and 32 ranks, what a rank but 0 reads of the H=1024 checkpoint, the 32-rank
    step under horovodrun's and mpirun's controllers, torchrun's lines after a kill at 32."""
    c = load("control_plane.json")
    stop = {(s["launcher"], s["ranks"]): s for s in c["stop"]}
    kill = {(k["launcher"], k["ranks"]): k for k in c["kill"]}
    assert all(k["names_the_killed_rank_alone"] for k in c["kill"])
    return {"control_plane.ckpt_1": f"{stop[('horovodrun', 1)]['checkpoint_bytes']:,}",
            "control_plane.ckpt_32": f"{stop[('horovodrun', 32)]['checkpoint_bytes']:,}",
            "control_plane.h1024_read_kb": f"{c['resume_h1024']['read_bytes'] / 1024:.0f}",
            "control_plane.h1024_file_mb": f"{c['resume_h1024']['file_bytes'] / 1e6:.0f}",
            "control_plane.horovodrun_step_32": f"{stop[('horovodrun', 32)]['step_s']:.1f}",
            "control_plane.mpirun_step_32": f"{stop[('mpirun', 32)]['step_s']:.2f}",
            "control_plane.torchrun_kill_lines_32": f"{kill[('torchrun', 32)]['lines_after_kill']}"}


@figures("docs/results/control_plane_lines.json")
def control_plane_lines() -> dict[str, str]:
    """The rehearsal again at 4 and 16 ranks, counting hvd-lm's own lines apart from the
    launchers': the most after a stop and after a kill, over every launcher and size."""
    c = load("control_plane_lines.json")
    assert {s["ranks"] for s in c["stop"]} == {4, 16}
    stop = max(s["hvd_lm_lines_after_stop"] for s in c["stop"])
    kill = max(k["hvd_lm_lines_after_kill"] for k in c["kill"])
    return {"control_plane.ours_after_stop": f"{stop}", "control_plane.ours_after_kill": f"{kill}"}
