import sys

from paratune.cli import main

sys.exit(main())
