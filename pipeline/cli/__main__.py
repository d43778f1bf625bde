"""``python -m pipeline.cli``: the ``rollout`` command."""

import sys

from pipeline.cli import main

sys.exit(main())
