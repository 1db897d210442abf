"""``python -m ember``: the Ember command line (see :mod:`ember.cli`)."""

import sys

from ember.cli import main

sys.exit(main())
