import sys

from ref_server.cli import main

sys.exit(main())
