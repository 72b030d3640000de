"""The work directory and the output folder of ``prepare``: what makes ``--resume`` continue a
run and ``--overwrite`` replace one.

Work lives in ``OUT/.prepare/``: every unit and bucket is written to a ``.partial`` folder and
renamed when complete (:func:`fresh_dir`, :func:`finish_dir`), and ``state.json`` records the
fingerprints of the settings and inputs and the layout (units, buckets) the work was cut into.
A resumed run reuses finished work only when all three match (:func:`setup_output`); a finished
corpus is recognised by its manifest's fingerprints (:func:`fingerprints`).

``prepare`` writes only into a new or empty folder, or one it wrote before (:func:`check_out`: a
folder of other files and no manifest, shard or work directory is refused untouched), and deletes
only files of its own names there: its shards, its manifest, its work directory, and the
temporary files a killed writer of those left (:func:`hvd_lm.util.atomic.remove_stale_temps`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from data_prep import sniff
from data_prep.settings import PrepareConfig, PrepareError
from hvd_lm.formats import manifest as manifests
from hvd_lm.formats.tokenizer import TOKENIZER_NAME
from hvd_lm.util.atomic import remove_stale_temps, write_text
from hvd_lm.util.digest import json_sha256
from hvd_lm.util.files import read_bounded
from hvd_lm.util.lock import LOCK_NAME

WORK_DIR = ".prepare"
SHARD_NAME = re.compile(r"^(train|val|test)-\d{5}\.h5\Z")


def written_by_prepare(name: str) -> bool:
    """Whether ``name`` is a file ``prepare`` writes into its output folder: a shard or the
    manifest (or, through :func:`check_out`, the work directory and the lock)."""
    return bool(SHARD_NAME.match(name)) or name == manifests.MANIFEST_NAME


def owned_by_prepare(path: Path, out: str | Path) -> bool:
    """Whether ``path`` (links resolved) is a file ``prepare`` writes or deletes in ``out``: a
    shard, the manifest, the lock, or anything in the work directory (what ``--summary-json``
    may not name: the summary would replace it, or be replaced)."""
    d, p = Path(out).resolve(), Path(path).resolve()
    return (p.parent == d and (written_by_prepare(p.name) or p.name in (WORK_DIR, LOCK_NAME))) \
        or d / WORK_DIR in p.parents


def check_out(out: str | Path) -> None:
    """Refuse an output folder that holds files but nothing ``prepare`` wrote (no manifest, no
    shard, no work directory, no lock): a link to a folder of other files, a folder of inputs, a
    home directory. Checked before the folder is locked or created, so a refused run touches
    nothing. (A folder ``prepare`` wrote before may hold other files too: they are never touched.)

    Raises:
        PrepareError: naming the folder (and where a link leads) and up to three of its entries.
    """
    out = Path(out)
    if not out.is_dir():
        return
    names = sorted(p.name for p in out.iterdir())
    # the lock alone: a prepare killed after taking it, before it made its work directory
    if not names or any(written_by_prepare(n) or n in (WORK_DIR, LOCK_NAME) for n in names):
        return
    where = f"{out} (a link to {out.resolve()})" if out.is_symlink() else str(out)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise PrepareError(f"{where} holds files, none of them prepared data ({shown}); prepare "
                       "writes into a new or empty folder, or one it wrote before: choose "
                       "another --out")


def finish_dir(partial: Path, final: Path) -> None:
    """Rename a complete ``partial`` folder to ``final`` (replacing an older one)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)


def fresh_dir(path: Path) -> Path:
    """``path`` as a new, empty folder (an earlier one is removed)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def shard_settings(cfg: PrepareConfig) -> dict:
    """The settings that decide the shards' bytes (hashed into the manifest's config_sha256)."""
    return {"tokenizer": TOKENIZER_NAME, "normalize": cfg.normalize,
            "min_chars": cfg.min_chars, "dedup": cfg.dedup, "seed": cfg.seed,
            "split": [float(r) for r in cfg.split], "shard_size": int(cfg.shard_size),
            "compression": cfg.compression, "utf8_errors": cfg.utf8_errors,
            "skip_bad": cfg.skip_bad}


def fingerprints(cfg: PrepareConfig, specs: list) -> tuple:
    """(settings + input names/sizes, input paths/sizes/mtimes) hashes, as the manifest keeps."""
    names = input_names([s.path for s in specs])
    config_fp = json_sha256({**shard_settings(cfg), "inputs": [
        [name, s.size, s.format, s.text_field] for name, s in zip(names, specs)]})
    return config_fp, json_sha256([[s.path, s.size, os.stat(s.path).st_mtime_ns] for s in specs])


#: Largest ``.prepare/state.json`` read: fingerprints and the layout (a few numbers per unit
#: and bucket).
STATE_MAX_BYTES = 16 << 20


def _own_json(path: Path, limit: int = manifests.MAX_MANIFEST_BYTES) -> dict:
    """A JSON object ``prepare`` wrote in its folder (the manifest, at most
    :data:`hvd_lm.formats.manifest.MAX_MANIFEST_BYTES` by default; ``state.json``) as a dict;
    {} when there is none, or it is damaged (not JSON, not an object: the run is redone).

    Raises:
        hvd_lm.util.files.FileRefused: a FIFO, a device or a socket by that name (never opened:
            a FIFO blocks, ``/dev/zero`` never ends), or a file over ``limit`` bytes (never read
            past it): named in one line, not mistaken for a damaged file and replaced.
    """
    try:
        raw = read_bounded(path, limit, "prepare writes this file itself: remove it, or use "
                           "another --out")
    except FileNotFoundError:
        return {}
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def other_run(old: dict, config_fp: str, inputs_fp: str) -> str | None:
    """What differs between a finished corpus (``old``: its manifest, with ``config_sha256``)
    and a run of these fingerprints (:func:`fingerprints`): ``"settings or inputs"``,
    ``"versions of the input files (sizes or modification times)"``, or None (the same run)."""
    if old["config_sha256"] != config_fp:
        return "settings or inputs"
    if old.get("inputs_sha256") != inputs_fp:
        return "versions of the input files (sizes or modification times)"
    return None


def finished_with_other_inputs(cfg: PrepareConfig) -> bool:
    """Whether ``cfg.out`` holds a finished corpus of other settings or input file versions.

    That is the case in which ``prepare`` with ``resume`` refuses (a re-copied input has a new
    modification time even when its bytes are the same). False when there is no manifest.

    Raises:
        data_prep.inputs.InputError: an input is missing, unreadable or of an unknown format.
    """
    old = _own_json(Path(cfg.out) / manifests.MANIFEST_NAME)
    if not old.get("config_sha256"):
        return False
    specs = [sniff.resolve_input(p, cfg.format, cfg.text_field, cfg.tar_members)
             for p in cfg.inputs]
    return other_run(old, *fingerprints(cfg, specs)) is not None


def input_names(paths: list) -> list:
    """Short, unique names of input files: paths relative to their common directory
    (``books/positive.review.gz``), a bare file name for a single input."""
    paths = [os.path.abspath(p) for p in paths]
    if not paths:
        return []
    common = os.path.commonpath([os.path.dirname(p) for p in paths])
    return [os.path.relpath(p, common) for p in paths]


def setup_output(cfg: PrepareConfig, config_fp: str, inputs_fp: str, layout: dict,
                  accept_complete: bool = True) -> dict | None:
    """Rank 0: claim the output directory, decide what earlier work to reuse, record the state.

    Returns:
        The existing manifest when resuming a finished run with the same settings and inputs
        (and ``accept_complete``), else None (the work folder is set up for the run).
    Raises:
        PrepareError: the directory holds an earlier run and neither --resume nor --overwrite.
        hvd_lm.util.files.FileRefused: its ``manifest.json`` or ``.prepare/state.json`` is not a
            regular file (a FIFO, a device) or is over its size budget.
    """
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / manifests.MANIFEST_NAME
    work = out / WORK_DIR
    ours = sorted(p for p in out.iterdir() if SHARD_NAME.match(p.name))
    if not (cfg.resume or cfg.overwrite) and (manifest_path.exists() or ours):
        raise PrepareError(f"{out} already holds prepared data (manifest or shards); pass "
                           "--resume to continue it or --overwrite to replace it")
    # (a work directory alone, from a run that failed before writing shards, is redone)
    remove_stale_temps(out, written_by_prepare)  # a killed writer's temporary shards and manifest
    state_path = work / "state.json"
    # only a resumed run reuses work (else the work folder is redone)
    state = (_own_json(state_path, STATE_MAX_BYTES) or None) if cfg.resume else None
    old = _own_json(manifest_path) if cfg.resume and accept_complete else {}
    if old.get("config_sha256"):  # a finished corpus: this run, or one of other inputs/settings
        if (what := other_run(old, config_fp, inputs_fp)) is None:
            return old
        raise PrepareError(
            f"{out} holds a finished corpus prepared with other {what}; --resume only "
            "continues the same run: pass --overwrite to replace it, or use another --out")
    manifest_path.unlink(missing_ok=True)  # never a manifest listing shards being replaced
    same_inputs = bool(state) and state.get("config_sha256") == config_fp and \
        state.get("inputs_sha256") == inputs_fp
    if cfg.overwrite or (state is not None and not same_inputs):
        for p in ours:
            p.unlink()
    if not (cfg.resume and same_inputs and state.get("layout") == layout) and work.exists():
        shutil.rmtree(work)  # no work of another layout, settings or inputs is reused
    for sub in ("map", "sorted"):
        (work / sub).mkdir(parents=True, exist_ok=True)
        for p in (work / sub).glob("*.partial"):
            shutil.rmtree(p)
    write_text(state_path, json.dumps({"config_sha256": config_fp,
                                       "inputs_sha256": inputs_fp, "layout": layout}, indent=1))
    return None
