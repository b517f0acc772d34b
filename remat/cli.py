"""`remat plan`: plan a bundled model under a budget and print the report."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="remat", description="activation rematerialization planner")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan a bundled model (remat.zoo) and print the summary")
    p.add_argument("--model", default="gpt2", help="one of remat.zoo.NAMES")
    p.add_argument("--size", default="tiny", help="tiny, bench or small")
    p.add_argument("--budget", default="70%", help="bytes, '800MB', '1.5GiB' or '70%%'")
    p.add_argument("--solver", default="auto")
    p.add_argument("-v", "--verbose", action="store_true")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if opts.verbose else logging.WARNING)

    import remat
    from remat import zoo

    if opts.model not in zoo.NAMES:
        parser.error(f"--model {opts.model!r} is not one of {list(zoo.NAMES)}")
    case = zoo.build(opts.model, size=opts.size)
    try:
        planned = remat.plan(case.model, case.args, case.kwargs, budget=opts.budget, solver=opts.solver)
    except remat.RematError as e:
        print(f"remat: {e}", file=sys.stderr)
        return 2
    print(planned.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
