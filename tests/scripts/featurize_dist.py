"""Featurize texts with hvd_lm.transfer.features.featurize under horovodrun/mpirun; rank 0 saves the
result.

Every rank reads the same texts, takes its round-robin share of the length-sorted batches and the
features are allgathered back in input order. tests/test_transfer.py compares the saved arrays
with a single-process run.

usage: featurize_dist.py CHECKPOINT TEXTS.json OUT.npz [--batch-size B] [--kinds cell,hidden,...]
           [--backend horovod|torch]
"""
import argparse
import json

import numpy as np
import torch

from hvd_lm import comm
from hvd_lm.model.load import load_model
from hvd_lm.transfer.run import featurize

ap = argparse.ArgumentParser()
ap.add_argument("checkpoint")
ap.add_argument("texts")
ap.add_argument("out")
ap.add_argument("--batch-size", type=int, default=3)
ap.add_argument("--kinds", default="cell,hidden,mean,max")
ap.add_argument("--max-chars", type=int, default=2000)
ap.add_argument("--backend", default="horovod")
args = ap.parse_args()

ctx = comm.init(backend=args.backend)
torch.set_num_threads(1)
model, _ = load_model(args.checkpoint)
with open(args.texts) as f:
    texts = json.load(f)
arrays = {}
for kind in args.kinds.split(","):
    res = featurize(model, texts, kind, max_chars=args.max_chars, batch_size=args.batch_size,
                    ctx=ctx, progress=False, desc=kind)
    arrays[kind] = res.features
if ctx.rank == 0:
    np.savez(args.out, world_size=np.array(ctx.size), **arrays)
print(f"rank {ctx.rank}/{ctx.size} done", flush=True)
