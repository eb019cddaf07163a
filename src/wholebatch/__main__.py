import sys

from wholebatch.cli.main import main

sys.exit(main())
