import sys

from bench.ledger.cli import main

sys.exit(main())
