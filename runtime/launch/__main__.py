"""``python -m runtime.launch``: the per-node launcher's command line (:func:`runtime.launch.main.main`)."""

import gc
import sys

from runtime.launch.main import main

code = main()
gc.freeze()   # the shutdown's collections would walk torch's objects (~0.5 s; more under load)
sys.exit(code)
