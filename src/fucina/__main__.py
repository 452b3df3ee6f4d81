import sys

from fucina.cli.main import main

sys.exit(main())
