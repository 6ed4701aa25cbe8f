"""``python -m gateway.cli``: the gateway's commands without ``bench`` (what benches start)."""

import sys

from gateway.cli.main import main

sys.exit(main())
