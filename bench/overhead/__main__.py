import sys

from bench.overhead.cli import main

sys.exit(main())
