"""``python -m partq``: the ``partq`` command."""

import sys

from partq.cli import main

sys.exit(main())
