"""``diffusiond bench``: the daemon against the forward-only limit, its own sync mode, and a
hand-written server, side by side in one run on the same model.

- ``limit``: the pipeline called in a loop in this process, outputs left on the device, one
  synchronize at the end: the ceiling for that model, size and batch.
- ``async``: the daemon as shipped, over its Unix socket, driven by concurrent clients that
  create jobs, follow their events and download every output.
- ``async-memory``: the same daemon with ``--no-persist`` (jobs in memory only), run in the same
  rounds as ``async`` to price the state dir (the database write before each 202, the output
  files).
- ``sync``: the same daemon with ``--output-mode sync`` (copy and pack before the next forward).
- ``naive``: the server people write by hand (``bench/naive.py``): one aiohttp handler that calls
  the pipeline under a lock with PIL output and encodes the PNG inline. Labelled as the baseline.

Every mode runs in rounds with the limit measured around each daemon run (``report.py`` says why).
Each mode's figure also comes as achieved TFLOP/s and a share of the device's peak (``flops.py``),
since ``x limit`` cannot say how far the limit itself is from the hardware.

The CLI builds this command's parser for every command, ``--help`` included, so importing the
package must not load torch: the runner imports the pipelines only inside ``run``.


``--alternate SPEC_A SPEC_B`` runs another scenario instead (``bench/alternate.py``): two models, requests
alternating between them, on a daemon whose ``--device-memory`` holds one, against both resident.
"""

import argparse

from diffusiond.bench import alternate, runner
from diffusiond.bench.runner import add_parser

__all__ = ["add_parser", "run"]


def run(args: argparse.Namespace) -> int:
    return alternate.run(args) if args.alternate else runner.run(args)
