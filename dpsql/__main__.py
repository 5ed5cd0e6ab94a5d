import sys

from dpsql.cli import main

sys.exit(main())
