import sys

from wholebatch.cli import main

sys.exit(main())
