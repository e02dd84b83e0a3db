import sys

from adaptive_spec.cli.main import main

sys.exit(main())
