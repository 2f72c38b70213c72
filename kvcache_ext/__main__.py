"""``python -m kvcache_ext`` = the ``kvcache-ext`` command."""
import sys

from kvcache_ext.cli import main

sys.exit(main())
