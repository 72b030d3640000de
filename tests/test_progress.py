"""Progress (hvd_lm/train/log.py): what a long command (eval, transfer, classify, generate,
visualize) says while it works: tqdm's bar on a terminal, whole lines with chars/s in a log."""
from __future__ import annotations

import io
import json

from hvd_lm.cli import main as cli_main
from hvd_lm.train.log import Progress
from tests.test_transfer_tools import trained  # noqa: F401 - the fixture: a checkpoint + classifier


def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_log(monkeypatch):
    """Progress: tqdm's bar (carriage returns) on a terminal, one whole line per refresh in a log
    (HVD_LM_PROGRESS_EVERY_S apart; here every update), nothing when disabled."""
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("HVD_LM_PROGRESS_EVERY_S", "1e-9")
    out = {}
    for name, f, enabled in (("tty", Terminal(), True), ("log", io.StringIO(), True),
                             ("off", io.StringIO(), False)):
        bar = Progress("hvd-lm eval (rank 0)", 3000, "char", enabled=enabled, file=f)
        for _ in range(3):
            bar.update(1000)
        bar.close()
        out[name] = f.getvalue()
    assert "\r" in out["tty"] and "\n" not in out["tty"].rstrip("\n")
    assert out["off"] == "" and "\r" not in out["log"]
    assert [x.split(", ")[0] for x in out["log"].splitlines()] == [
        f"hvd-lm eval (rank 0): {n:,} of 3,000 chars ({p}%)"
        for n, p in ((1000, 33), (2000, 67), (3000, 100))]


def test_a_redirected_log_gets_progress_lines_not_a_bar(tmp_path, trained, capsys, monkeypatch):
    """Without --no-progress, classify, generate and visualize (and eval, transfer: the same
    Progress) write whole progress lines with chars/s into a log (stderr captured here, as a
    redirected job log is), never a bar's carriage returns; the last line counts every char."""
    monkeypatch.setenv("HVD_LM_PROGRESS_EVERY_S", "1e-9")  # a line at every update, not every 10 s

    def lines(err, what):
        assert "\r" not in err, err
        return [x for x in err.splitlines() if x.startswith(f"hvd-lm {what}: ")]

    assert cli_main(["classify", str(trained["ckpt"]), str(trained["dir"] / "out"), "--input",
                     str(trained["test"]), "--text-field", "review", "--output",
                     str(tmp_path / "p.jsonl")]) == 0
    cap = capsys.readouterr()
    got = lines(cap.err, "classify")
    assert "classified 80 texts" in cap.out and got and all(" chars/s, " in x for x in got)
    chars = sum(len(json.loads(x)["text"]) for x in open(tmp_path / "p.jsonl"))
    assert got[-1].startswith(f"hvd-lm classify: {chars:,} chars, "), got[-1]
    assert cli_main(["generate", str(trained["ckpt"]), "--length", "30", "--samples", "2"]) == 0
    got = lines(capsys.readouterr().err, "generate")
    assert len(got) == 30 and got[-1].startswith("hvd-lm generate: 60 of 60 chars (100%), ")
    assert cli_main(["visualize", str(trained["ckpt"]), "--neuron", "1", "--input",
                     str(trained["test"]), "--text-field", "review", "--max-texts", "3",
                     "--max-chars", "40", "--out", str(tmp_path / "h.html")]) == 0
    got = lines(capsys.readouterr().err, "visualize")
    texts = [json.loads(x)["review"] for x in open(trained["test"])][:3]
    n = sum(min(40, len(t.encode())) for t in texts)  # the bytes the model reads
    assert got and got[-1].startswith(f"hvd-lm visualize: {n} of {n} chars (100%), "), got
