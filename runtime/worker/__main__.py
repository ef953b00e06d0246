"""``python -m runtime.worker SCRIPT [ARGS...]``: each worker's first code (:mod:`runtime.worker.start`)."""

import sys

from runtime.worker.start import main

main(sys.argv[1:])
