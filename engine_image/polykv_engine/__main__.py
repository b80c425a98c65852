"""``python -m polykv_engine``: the same as ``polykv-engine``."""

import sys

from polykv_engine.boot import main

sys.exit(main())
