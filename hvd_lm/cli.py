"""The ``hvd-lm`` command line: one table, command -> (module, command object, help).

Each command is a :class:`hvd_lm.options.Command` defined in the module that owns its concept:
its settings' dataclass (flags and YAML generated from it) and the function that runs it. This
file only wires them up: it imports the one module the command line names (so ``hvd-lm prepare``
never loads the training stack and ``hvd-lm --help`` loads nothing), and
:meth:`~hvd_lm.options.Command.invoke` turns an error into one ``ERROR:`` line (``--debug``:
the traceback); so does the parser for a bad flag (:class:`hvd_lm.options.ArgumentParser`).

Exit status: 0 done, 1 a runtime error, 2 a usage or configuration error (argparse's too).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hvd_lm.options import ArgumentParser

#: command -> (module, Command attribute, one-line help).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "check-build": ("hvd_lm.install.check_build", "CHECK_BUILD",
                    "verify Horovod has PyTorch, MPI and Gloo (and NCCL on CUDA) built in"),
    "prepare": ("data_prep.cli", "PREPARE",
                "turn review text files into shuffled, split, checksummed HDF5 shards"),
    "verify": ("data_prep.cli", "VERIFY", "re-check a shard directory against its manifest"),
    "train": ("hvd_lm.train.loop", "TRAIN",
              "train the LM (under horovodrun/mpirun, or one process)"),
    "eval": ("hvd_lm.train.evaluate", "EVAL",
             "bits per character of a checkpoint on a shard split"),
    "transfer": ("hvd_lm.transfer.run", "TRANSFER", "sentiment transfer: LM features + L1 "
                 "logistic regression, sentiment neuron, TF-IDF baseline"),
    "classify": ("hvd_lm.transfer.classify", "CLASSIFY", "apply a classifier saved by transfer "
                 "to new texts: probability and label per text"),
    "generate": ("hvd_lm.transfer.generate", "GENERATE", "sample text from the LM; steer it by "
                 "holding a unit (--neuron N --overwrite V); per-character heatmap"),
    "visualize": ("hvd_lm.transfer.generate", "VISUALIZE", "per-character heatmap (HTML/PNG) "
                  "of a unit (default: the sentiment neuron) over given texts"),
    "export": ("hvd_lm.model.load", "EXPORT", "write a checkpoint's model as safetensors + "
               "config.json, which every command that takes a checkpoint also loads"),
    "import-openai": ("hvd_lm.model.load", "IMPORT_OPENAI", "OpenAI's released "
                      "sentiment-neuron mLSTM (15 .npy arrays) as an exported folder"),
    "kernels": ("hvd_lm.model.kernels_aot", "KERNELS_AOT", "build the fused mLSTM's Triton "
                "kernels ahead of time for a GPU (no GPU needed): registers, spills, smem"),
    "launch": ("hvd_lm.jobs.job_plans", "LAUNCH", "render a launch script (horovodrun, mpirun, "
               "SLURM, PBS) or a scaling sweep"),
    "doctor": ("hvd_lm.jobs.doctor", "DOCTOR", "preflight of a multi-node launch: ssh both ways, "
               "same Python/hvd_lm, the shared network interface (and the flags to use), "
               "ports, shards, GPUs per host"),
    "download": ("hvd_lm.jobs.download", "DOWNLOAD",
                 "fetch the demo's public review files, each verified against its sha256"),
    "demo": ("hvd_lm.jobs.demo", "DEMO", "end to end on real reviews: prepare, train on 2 "
             "ranks, evaluate vs xz/gzip, SST-2 transfer, report"),
}

DESCRIPTION = ("Horovod/MPI data-parallel training of byte-level mLSTM language models on review "
               "text, and sentiment transfer (see README.md).")


def build_parser(argv: list[str] | None = None, commands: dict | None = None,
                 prog: str = "hvd-lm", description: str = DESCRIPTION) -> argparse.ArgumentParser:
    """The ``hvd-lm`` parser (``commands``, ``prog``: another table's, as ``python -m
    benchmarks`` has). Every command is listed with its help; only the command named in
    ``argv`` (all of them when ``argv`` is None, e.g. for documentation) gets its arguments."""
    parser = ArgumentParser(prog=prog, description=description)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    words = [a for a in (argv or []) if not a.startswith("-")]
    for name, (module, attr, text) in (COMMANDS if commands is None else commands).items():
        p = sub.add_parser(name, help=text, description=text)
        if argv is None or words[:1] == [name]:
            # The one dynamic import: only the module of the command that runs is loaded.
            command = getattr(importlib.import_module(module), attr)
            command.add_arguments(p)
            p.set_defaults(command_obj=command)
    return parser


def main(argv: list[str] | None = None, commands: dict | None = None, prog: str = "hvd-lm",
         description: str = DESCRIPTION) -> int:
    """Entry point of the ``hvd-lm`` console script (and, given its table, of ``python -m
    benchmarks``); returns the exit status."""
    from hvd_lm.comm.world import stand_in_for_horovodrun_shell

    stand_in_for_horovodrun_shell()  # a rank under horovodrun --gloo where /bin/sh is bash
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv, commands, prog, description).parse_args(argv)
    return args.command_obj.invoke(args, f"{prog} {args.command}")


if __name__ == "__main__":  # python -m hvd_lm.cli, as python -m hvd_lm
    sys.exit(main())
