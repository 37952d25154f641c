"""`python -m opd_trainer.cli` runs the `opd` command."""

import sys

from opd_trainer.cli.main import main

sys.exit(main())
