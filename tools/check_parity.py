#!/usr/bin/env python
"""Max |logits| difference between the HF model (transformers) and the Megatron model, float32.

    python tools/check_parity.py --hf-dir H --ckpt M                  # one process
    torchrun --nproc-per-node 4 tools/check_parity.py --hf-dir H --ckpt M --tp 2 --pp 2
    torchrun --nproc-per-node 4 tools/check_parity.py --hf-dir H --ckpt M --tp 2 --ep 2  # MoE: dp=2

Exits 1 when the difference exceeds --tol.
"""

import argparse
import math
import os
import shlex
import sys


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True)
    p.add_argument(
        "--ckpt",
        default=None,
        help="converted model dir or a training checkpoint's iter_* dir (any backend, TP/PP); "
        "default: load --hf-dir through the mapping",
    )
    p.add_argument(
        "--backend",
        choices=["local", "te"],
        default="local",
        help="layer spec of the Megatron model (te: Transformer Engine, GPU)",
    )
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert parallel (MoE models)")
    p.add_argument("--etp", type=int, default=1, help="tensor parallel inside each expert (MoE models)")
    p.add_argument("--seq-len", type=int, default=24)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tol", type=float, default=1e-4)
    args = p.parse_args(argv)
    ranks = args.pp * math.lcm(args.tp, args.ep * args.etp)  # the smallest world both grids fit
    if ranks > 1 and "RANK" not in os.environ:  # plain `python`: one process, but TP x PP ranks are needed
        script = sys.argv[0] if argv is None else "tools/check_parity.py"
        rest = shlex.join(sys.argv[1:] if argv is None else list(argv))
        ep = f" --ep {args.ep}" if args.ep > 1 else ""
        print(
            f"error: --tp {args.tp} --pp {args.pp}{ep} needs {ranks} processes, one per rank; launch them with\n"
            f"  torchrun --nproc-per-node {ranks} {script} {rest}",
            file=sys.stderr,
        )
        return 2
    from megatron_klear.checkpoint.parity import check_parity
    from megatron_klear.platform import is_rank0
    from megatron_klear.platform.entry import run_entry_point

    def run():
        diff = check_parity(
            args.hf_dir,
            ckpt_dir=args.ckpt,
            tp=args.tp,
            pp=args.pp,
            batch=args.batch,
            seq_len=args.seq_len,
            backend=args.backend,
            ep=args.ep,
            etp=args.etp,
        )
        ok = diff <= args.tol
        if is_rank0():
            print(
                f"parity tp={args.tp} pp={args.pp} ep={args.ep}: max |logits diff| = {diff:.3e} "
                f"({'OK' if ok else 'FAIL'}, tolerance {args.tol:.0e})"
            )
        return 0 if ok else 1

    return run_entry_point(run)


if __name__ == "__main__":
    sys.exit(main())
