"""``python -m runtime.launch``: the per-node launcher's command line (:func:`runtime.launch.main.main`)."""

import sys

from runtime.launch.main import main

sys.exit(main())
