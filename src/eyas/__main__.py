import sys

from eyas.cli import main

sys.exit(main())
