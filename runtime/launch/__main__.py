"""``python -m runtime.launch``: the per-node launcher's command line (:func:`runtime.launch.main.main`)."""

import gc
import sys

from runtime.launch import early_signals

early_signals.hold()   # a stop's signal during the imports below is kept for the forwarder

from runtime.launch.main import main  # noqa: E402

code = main()
gc.freeze()   # the shutdown's collections would walk torch's objects (~0.5 s; more under load)
sys.exit(code)
