"""A user module that ends the process when imported (``sys.exit("reason")`` at import): the config's importer
must turn it into one line with the reason (tests/unit/test_config.py)."""

import sys

sys.exit("this module needs a GPU")
