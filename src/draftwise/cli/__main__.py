"""``python -m draftwise.cli``: the ``draftwise`` command."""

import sys

from . import main

sys.exit(main())
