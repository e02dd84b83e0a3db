import sys

from adaptive_spec.cli import main

sys.exit(main())
