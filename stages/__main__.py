"""Entry point of one stage process: `python -m conveyor.stages STAGE INDEX CONFIG_JSON`."""

import sys

from conveyor.stages.runtime import main

sys.exit(main(sys.argv[1:]))
